"""Log-probs renormalized over a kept set of ids per row (top-p replay: the rollout's nucleus),
from the final hidden states and the vocab-parallel output weight. Only the kept ids' logits are
computed — one dot product per (row, kept id) pair, P values in all — never a [T, V] mask or
logits; under tensor parallelism each rank scores the pairs of its vocab shard and one SUM
all-reduce of the P logits joins them. Backward recomputes the pairs chunk by chunk (dL/dh
summed over the ranks once, as the fused head's). In the invariant mode a row's value depends on
its own pairs alone: the dot products in blocks of one shape, the exponentials in fixed row blocks,
their sums in 64-bit fixed point (exact in any order)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl_patches.ops import _checks, _dist, _vocab
from megatron_rl_patches.ops._dtype import compute_dtype
from megatron_rl_patches.ops._rows import RowSelection, splitmix64, unselected_as
from megatron_rl_patches.ops.invariance import resolve_for_vocab
from megatron_rl_patches.ops.kernels.sources import gather_rows, reduce_rows
from megatron_rl_patches.ops.lm_head import check_lm_head_inputs
from megatron_rl_patches.ops.row_blocks import in_row_blocks

__all__ = ["lm_head_kept_log_probs"]

_SEEDS = (0x2545F4914F6CDD1D, 0x5851F42D4C957F2D)  # two independent hashes of each pair
FIXED_BITS = 44  # the invariant mode's sums: e^u in [0, 1] as integers of 2^-44 (as the invariant tiles)
INVARIANT_BLOCK = 64  # pairs per dot-product block in the invariant mode (every block this shape)


def lm_head_kept_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    kept_ids: torch.Tensor,
    kept_rows: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    row_mask: torch.Tensor | None = None,
    invariant: bool | None = None,
) -> torch.Tensor:
    """log p(tokens[r]) renormalized over row r's kept set: z_t − logsumexp of z over
    {kept_ids[j] : kept_rows[j] == r} ∪ {tokens[r]}, with z = hidden·weightᵀ/τ. The target always
    counts (slime's top-p keep-mask restores it), so a row with no kept id gets 0; repeated ids
    count once. Returns [T] (fp32, fp64 for fp64 inputs); gradients flow to hidden and weight.

    hidden, weight, tokens, `tp_group`, `sequence_parallel`, `temperature`, `vocab_size` and
    `row_mask` as in `lm_head_log_probs_and_entropy` (unselected rows: 0, no gradient; their kept
    ids are ignored). kept_ids [P] global ids and kept_rows [P] their (global) row, in any order;
    the same on every tensor-parallel rank (checked with one small collective). `chunk_size`:
    pairs per chunk (None: a byte budget for the [chunk, H] products). `invariant`: each row's
    value a function of its hidden row, kept ids and the weight alone, bit for bit (None: the
    setting ``MEGATRON_RL_PATCHES_INVARIANT``); gradients exact, not bit-invariant."""
    _, n_rows, vocab = check_lm_head_inputs(hidden, weight, tp_group, sequence_parallel, vocab_size, None)
    checks = _checks.DeviceChecks()
    tau = _checks.check_temperature(temperature, (n_rows,), hidden.device, checks, hidden.dtype)
    invariant = resolve_for_vocab(invariant, vocab, "lm_head_kept_log_probs", tp_group,
                                  match=_checks.collective_values(n_rows, vocab, tau))
    chunk = _checks.check_chunk_size(chunk_size)
    _checks.check_tokens_shape(tokens, n_rows, hidden.device, "(all rows, also under sequence parallelism)", "hidden")
    selection = RowSelection.of(row_mask, n_rows, hidden.device, "hidden (all rows)", tp_group)
    _checks.require_tokens_in_vocab(unselected_as(tokens, selection), vocab, checks, tp_group)
    ids, rows = _check_pairs(kept_ids, kept_rows, n_rows, vocab, hidden.device, checks)

    targets = torch.arange(n_rows, device=hidden.device) if selection.rows is None else selection.rows
    if selection.mask is not None:  # the kept ids of unselected rows are ignored
        chosen = selection.mask[rows.clamp(0, n_rows - 1)] if n_rows else rows.new_zeros(rows.shape, dtype=torch.bool)
        ids, rows = ids[chosen], rows[chosen]
    keys = torch.cat([rows * vocab + ids, targets * vocab + tokens.to(torch.long)[targets]])
    _require_same_pairs(keys, tp_group, checks)
    checks.raise_first()  # before any collective whose size depends on the pairs
    pairs = torch.unique(keys)  # sorted: the same order on every rank
    target_pair = torch.searchsorted(pairs, keys[ids.numel():])
    pair_rows, pair_ids = pairs // vocab, pairs % vocab
    dtype = compute_dtype(hidden.dtype)
    scale = (1.0 / tau) if not isinstance(tau, torch.Tensor) else (1.0 / tau.to(dtype)).reshape(-1)
    pair_scale = scale[pair_rows] if isinstance(scale, torch.Tensor) and scale.numel() > 1 else \
        torch.full(pair_rows.shape, float(scale), dtype=dtype, device=hidden.device)
    spec = _vocab.head_spec(weight, tp_group, sequence_parallel, vocab, None, "lm_head_kept_log_probs",
                            invariant=invariant)
    local, owned = _vocab.local_columns(pair_ids, spec.first_id, spec.n_valid)
    budget = INVARIANT_BLOCK if invariant else chunk or _vocab.default_chunk_rows(hidden.size(1), hidden.device, dtype)
    z = KeptLogits.apply(pair_rows, local, owned, pair_scale, spec, budget, hidden, weight)
    finite = torch.isfinite(z)
    checks.require(finite, lambda: ValueError(
        f"lm_head_kept_log_probs: the logits (hidden @ weight.T) / temperature are not finite at rows "
        f"{torch.unique(pair_rows[~finite])[:8].tolist()}; check hidden and weight for NaN/inf"))
    checks.raise_first()
    top = torch.full((n_rows,), -torch.inf, dtype=dtype, device=hidden.device)
    top = top.scatter_reduce(0, pair_rows, z.detach(), "amax")
    if not invariant:
        sums = torch.zeros(n_rows, dtype=dtype, device=hidden.device).index_add(0, pair_rows,
                                                                                 (z - top[pair_rows]).exp())
        return selection.scatter(z[target_pair] - (top[targets] + sums[targets].log()))
    e = in_row_blocks(lambda zs, shifts: (zs - shifts).exp(), z.numel(), z, top[pair_rows])
    sums = torch.zeros(n_rows, dtype=dtype, device=hidden.device).index_add(0, pair_rows, e)
    exact = torch.zeros(n_rows, dtype=torch.int64, device=hidden.device).index_add(
        0, pair_rows, (e.detach() * float(2 ** FIXED_BITS)).to(torch.int64))
    # the exact sums' value, the float sums' gradient: x - x is exactly 0
    sums = exact.to(torch.float64).mul(2.0 ** -FIXED_BITS).to(dtype) + (sums - sums.detach())
    log_probs = in_row_blocks(lambda zt, t, s: zt - (t + s.log()), targets.numel(), z[target_pair], top[targets],
                              sums[targets])
    return selection.scatter(log_probs)


def _check_pairs(kept_ids: object, kept_rows: object, n_rows: int, vocab: int, device: torch.device,
                 checks: _checks.DeviceChecks) -> tuple[torch.Tensor, torch.Tensor]:
    """kept_ids and kept_rows: id tensors [P] on `device`, ids in [0, vocab), rows in [0, n_rows)."""
    ids = _checks.check_id_tensor(kept_ids, "kept_ids", "[P] (the kept ids of every row, flat)")
    rows = _checks.check_id_tensor(kept_rows, "kept_rows", "[P] (the row of each kept id)")
    if ids.dim() != 1 or rows.shape != ids.shape:
        raise ValueError(f"kept_ids and kept_rows must be 1-D of the same length [P], got {tuple(ids.shape)} and "
                         f"{tuple(rows.shape)}; flatten per-row id lists and repeat each row index per id")
    if ids.device != device or rows.device != device:
        raise ValueError(f"kept_ids ({ids.device}) and kept_rows ({rows.device}) must be on hidden's device "
                         f"{device}; move them together")
    ids, rows = ids.to(torch.long), rows.to(torch.long)
    bad_ids, bad_rows = (ids < 0) | (ids >= vocab), (rows < 0) | (rows >= n_rows)
    checks.require(~bad_ids, lambda: ValueError(
        f"kept_ids must be global ids in [0, {vocab}); e.g. {ids[bad_ids][:4].tolist()} are outside"))
    checks.require(~bad_rows, lambda: ValueError(
        f"kept_rows must be row indices in [0, {n_rows}) (rows of hidden, all rows under sequence parallelism); "
        f"e.g. {rows[bad_rows][:4].tolist()} are outside"))
    return ids, rows


def _require_same_pairs(keys: torch.Tensor, group: dist.ProcessGroup | None, checks: _checks.DeviceChecks) -> None:
    """Under tensor parallelism: every rank holds the same (row, id) pairs and targets (their count
    and two hash sums compared with one all-gather), else a ValueError on every rank — never
    all-reduces of different sizes."""
    if _dist.tp_size(group) <= 1:
        return
    sums = [splitmix64(keys ^ seed).sum() if keys.numel() else keys.new_zeros(()) for seed in _SEEDS]
    mine = torch.stack([keys.new_tensor(keys.numel()), *sums])
    every = _dist.all_gather_last_dim(mine, group).reshape(-1, mine.numel())
    checks.require((every == mine).all(), lambda: ValueError(
        "lm_head_kept_log_probs: kept_ids / kept_rows / tokens differ across the tensor-parallel ranks; pass the "
        "same kept ids, rows and targets on every rank of tp_group"))


class KeptLogits(torch.autograd.Function):
    """z [P] = hidden[row]·weight[id]/τ for each (row, id) pair, summed over the tensor-parallel
    ranks (each scores the pairs of its shard: `owned`, at local column `local`). Saves hidden
    (this rank's rows), weight and the pairs; backward recomputes nothing larger than a chunk."""

    @staticmethod
    def forward(ctx, rows, local, owned, scale, spec, budget, hidden, weight):
        index = torch.nonzero(owned).squeeze(1)
        dtype = compute_dtype(hidden.dtype)
        h = gather_rows(hidden.detach(), spec.group, spec.sequence_parallel)
        z = torch.zeros(rows.numel(), dtype=dtype, device=hidden.device)
        for start in range(0, index.numel(), budget):
            part = index[start: start + budget]
            n = part.numel()
            if spec.invariant and n < budget:  # one block shape: a pair's dot never depends on the pair count
                part = torch.cat([part, part[:1].expand(budget - n)])
            dots = (h[rows[part]].to(dtype) * weight.detach()[local[part]].to(dtype)).sum(-1)
            z[part[:n]] = (dots * scale[part])[:n]
        _dist.all_reduce_sum_(z, spec.group)
        ctx.save_for_backward(rows, local, index, scale, hidden, weight)
        ctx.spec, ctx.budget = spec, budget
        return z

    @staticmethod
    @_vocab.reject_double_backward
    def backward(ctx, grad_z):
        rows, local, index, scale, hidden, weight = ctx.saved_tensors
        spec = ctx.spec
        dtype = compute_dtype(hidden.dtype)
        h = gather_rows(hidden.detach(), spec.group, spec.sequence_parallel)
        want_h, want_w = ctx.needs_input_grad[6], ctx.needs_input_grad[7]
        grad_h = torch.zeros(h.shape, dtype=dtype, device=h.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if want_w else None
        for start in range(0, index.numel(), ctx.budget):
            part = index[start: start + ctx.budget]
            g = (grad_z[part].to(dtype) * scale[part])[:, None]
            if grad_h is not None:
                grad_h.index_add_(0, rows[part], g * weight[local[part]].to(dtype))
            if grad_w is not None:
                grad_w.index_add_(0, local[part], g * h[rows[part]].to(dtype))
        if grad_h is not None:
            grad_h = reduce_rows(grad_h, spec.group, spec.sequence_parallel).to(hidden.dtype)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return None, None, None, None, None, None, grad_h, grad_w
