"""The fused LM head: per-token log-probs, entropy and top-k buckets straight from the final
hidden states and the (vocab-parallel) output weight. The logits z = h·Wᵀ/τ are computed tile
by tile and never exist as a [T, V] tensor, in forward or backward.

Forward walks (row tile × vocab tile), keeping per row a running max and exp-sums (online
softmax); ranks combine them with one MAX and one SUM all-reduce of O(T) values per call.
Backward recomputes each tile's logits (one extra T·H·V/tp matmul: 4/3 of the unfused flops),
forms dL/dz = a·(onehot − p) − b·p·(log p + H) and accumulates grad_hidden and grad_weight in
fp32; grad_hidden is summed over the tensor-parallel ranks once (reduce-scattered under sequence
parallelism). Saved for backward: hidden (the local slice under sequence parallelism), weight,
tokens and ≤ 5 numbers per token. Semantics and errors are those of `log_probs_and_entropy` and
the top-k ops on `hidden @ weight.T` (docs/fused-lm-head.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl_patches.ops import _dist, _vocab
from megatron_rl_patches.ops._lm_head_tiles import RowStats, logits_tile, tile_shape

__all__ = ["lm_head_log_probs_and_entropy", "lm_head_topk_ids", "lm_head_topk_logprobs"]


# ----------------------------------------------------------------------------- plumbing


def _gather_rows(hidden: torch.Tensor, spec: _vocab.OpSpec) -> torch.Tensor:
    """Under sequence parallelism every rank's [T/tp, H] slice, concatenated in rank order."""
    if not spec.sequence_parallel or _dist.tp_size(spec.group) == 1:
        return hidden
    parts = [torch.empty_like(hidden) for _ in range(_dist.tp_size(spec.group))]
    # all-gather over the tensor-parallel group of each rank's sequence-parallel rows: every
    # rank's vocab shard needs the logits of all T rows
    dist.all_gather(parts, hidden.contiguous(), group=spec.group)
    return torch.cat(parts)


def _reduce_rows(grad_hidden: torch.Tensor, spec: _vocab.OpSpec) -> torch.Tensor:
    """grad_hidden summed over the tensor-parallel ranks (each rank's vocab shard contributes);
    under sequence parallelism only this rank's rows are kept (a reduce-scatter)."""
    size = _dist.tp_size(spec.group)
    if size == 1:
        return grad_hidden
    if spec.sequence_parallel and dist.get_backend(spec.group) != "gloo":  # gloo has no reduce-scatter
        out = grad_hidden.new_empty(grad_hidden.size(0) // size, grad_hidden.size(1))
        # reduce-scatter (SUM) over the tensor-parallel group: each rank's vocab shard adds its
        # part of dL/dh for every row; each rank keeps the sum over its own sequence-parallel rows
        dist.reduce_scatter_tensor(out, grad_hidden.contiguous(), group=spec.group)
        return out
    # SUM all-reduce over the tensor-parallel group: dL/dh is the sum of every vocab shard's part
    dist.all_reduce(grad_hidden, group=spec.group)
    if not spec.sequence_parallel:
        return grad_hidden
    rows = grad_hidden.size(0) // size
    rank = _dist.tp_rank(spec.group)
    return grad_hidden[rank * rows : (rank + 1) * rows]


def _accumulators(hidden: torch.Tensor, weight: torch.Tensor, n_rows: int, needs: tuple[bool, bool]):
    """fp32 (fp64 for fp64 inputs) gradient accumulators, cast once at the end."""
    dtype = _vocab.compute_dtype(hidden.dtype)
    grad_h = torch.zeros(n_rows, hidden.size(1), dtype=dtype, device=hidden.device) if needs[0] else None
    grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if needs[1] else None
    return grad_h, grad_w


def _accumulate(grad_h, grad_w, dz: torch.Tensor, h: torch.Tensor, w: torch.Tensor, rows: slice, cols: slice) -> None:
    """grad_h[rows] += dz·w, grad_w[cols] += dzᵀ·h (matmuls in the inputs' dtype)."""
    if h.dtype == dz.dtype:
        if grad_h is not None:
            grad_h[rows].addmm_(dz, w)
        if grad_w is not None:
            grad_w[cols].addmm_(dz.t(), h)
        return
    dz = dz.to(h.dtype)
    if grad_h is not None:
        grad_h[rows] += torch.matmul(dz, w)
    if grad_w is not None:
        grad_w[cols] += torch.matmul(dz.t(), h)


def _column_marks(cols: torch.Tensor, owned: torch.Tensor, c0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ids [r, m] (local columns, `owned` by this rank): their column in the tile [c0, c0 +
    width) (clamped) and whether they fall in it. No host sync."""
    local = cols - c0
    inside = owned & (local >= 0) & (local < width)
    return local.clamp(0, max(width - 1, 0)), inside


def _marks(x: torch.Tensor, local: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """[r, c] bool: the columns of the ids that fall in this tile. Ids outside it were clamped onto
    tile columns, so marks are added up (a plain scatter could let them overwrite a real mark)."""
    return torch.zeros(x.shape, dtype=torch.int32, device=x.device).scatter_add_(1, local, inside.to(torch.int32)) > 0


def _replace_at(dz: torch.Tensor, local: torch.Tensor, inside: torch.Tensor, value: torch.Tensor) -> None:
    """dz[row, local] = value where `inside`, as an added difference (duplicate clamped columns add 0)."""
    current = dz.gather(1, local)
    dz.scatter_add_(1, local, torch.where(inside, value - current, 0.0))


def _tile_loop(h_full: torch.Tensor, weight: torch.Tensor, spec: _vocab.OpSpec, dtype: torch.dtype):
    """(rows, cols, x) for every logits tile, x = h[rows]·weight[cols]ᵀ in the compute dtype."""
    n_rows = h_full.size(0)
    row_tile, col_tile = tile_shape(n_rows, spec.n_valid, h_full.device, spec.chunk_rows)
    buf = torch.empty(row_tile, col_tile, dtype=dtype, device=h_full.device)
    for r0, r1 in _vocab.row_chunks(n_rows, row_tile):
        h = h_full[r0:r1]
        for c0, c1 in _vocab.row_chunks(spec.n_valid, col_tile):
            yield slice(r0, r1), slice(c0, c1), logits_tile(h, weight[c0:c1], buf[: r1 - r0, : c1 - c0])


# ----------------------------------------------------------------------------- validation


def _check_common(hidden, weight, tp_group, sequence_parallel, vocab_size, chunk_size) -> tuple[int, int, int]:
    """(local rows, global rows, global vocab); TypeError/ValueError naming the argument."""
    _vocab.check_float_tensor(hidden, "hidden", "[T, H] (under sequence parallelism this rank's [T/tp, H])")
    _vocab.check_float_tensor(weight, "weight", "[V_local, H] (this rank's vocab shard of the output weight)")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [T, H], got shape {tuple(hidden.shape)}; flatten [s, b, h] first")
    if weight.dim() != 2 or weight.size(1) != hidden.size(1) or weight.size(0) == 0:
        raise ValueError(
            f"weight must be [V_local, H] with H = {hidden.size(1)} (hidden's last dim) and V_local > 0, "
            f"got shape {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"hidden and weight must share dtype and device, got {hidden.dtype}/{hidden.device} and "
            f"{weight.dtype}/{weight.device}"
        )
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    _vocab.check_group(tp_group)
    _vocab.check_chunk_size(chunk_size)
    vocab = _vocab.global_vocab(weight.size(0), tp_group, vocab_size)
    rows = hidden.size(0) * (_dist.tp_size(tp_group) if sequence_parallel else 1)
    return hidden.size(0), rows, vocab


def _spec(hidden, weight, tp_group, sequence_parallel, vocab, chunk_size, op, **extra) -> _vocab.OpSpec:
    return _vocab.op_spec(weight.size(0), tp_group, vocab, chunk_size, op, arg=_LOGITS,
                          sequence_parallel=bool(sequence_parallel and _dist.tp_size(tp_group) > 1), **extra)


_LOGITS = "logits (hidden @ weight.T)"  # what the messages call the logits that never exist


# ----------------------------------------------------------------------------- log-probs + entropy

class _LMHeadLogProbs(torch.autograd.Function):
    """log p(target) (over kept ids when masked) and entropy H of softmax(h·Wᵀ/τ), no logits kept."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, keep_mask, tau, spec: _vocab.OpSpec, checks):  # type: ignore[override]
        h_full = _gather_rows(hidden, spec)
        masked = keep_mask is not None
        scale = _vocab.row_scale(tau, h_full.size(0), _vocab.compute_dtype(hidden.dtype))
        stats, x_target = _log_prob_tile_stats(h_full, weight, tokens, keep_mask, scale, spec)
        out = _combine(stats, x_target, scale, spec, masked)
        bad = _vocab.bad_row_codes(out["raw_max"])
        if masked:
            bad = torch.where((bad == 0) & torch.isneginf(out["log_s_kept"]), _vocab.BAD_KEPT_NEG_INF, bad)
        checks.require(bad == 0, lambda: _vocab.bad_rows_error(spec.op, spec.arg, bad))
        checks.raise_first()  # the call's one host sync: input checks and bad rows at once
        log_probs = out["log_p_kept"] if masked else out["log_p"]
        entropy = out["log_s"] - out["mean"] if spec.with_entropy else log_probs.new_empty(0)
        needed = [out["shift"], out["log_s"]] + ([out["mean"]] if spec.entropy_grad else [])
        if masked:
            needed += [out["shift_kept"], out["log_s_kept"]]
        ctx.spec, ctx.masked, ctx.tensor_tau = spec, masked, isinstance(tau, torch.Tensor)
        ctx.tau = None if ctx.tensor_tau else tau
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, tokens, torch.stack(needed), keep_mask,
                              tau if ctx.tensor_tau else None)
        if not spec.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    @_vocab.reject_double_backward
    def backward(ctx, grad_log_probs, grad_entropy):  # type: ignore[override]
        hidden, weight, tokens, stats, keep_mask, tau = ctx.saved_tensors
        spec: _vocab.OpSpec = ctx.spec
        none = (None,) * 5
        grad_entropy = grad_entropy if spec.entropy_grad else None
        if (grad_log_probs is None and grad_entropy is None) or not any(ctx.needs_input_grad[:2]):
            return (None, None) + none
        h_full = _gather_rows(hidden, spec)
        scale = _vocab.row_scale(tau if ctx.tensor_tau else ctx.tau, h_full.size(0), stats.dtype)
        row = _log_prob_rows(stats, grad_log_probs, grad_entropy, scale, tokens, keep_mask if ctx.masked else None, spec)
        grad_h, grad_w = _accumulators(hidden, weight, h_full.size(0), ctx.needs_input_grad[:2])
        for rows, cols, x in _tile_loop(h_full, weight, spec, stats.dtype):
            dz = _log_prob_tile_grad(x, rows, cols, _vocab.scale_rows(scale, rows), row)
            _accumulate(grad_h, grad_w, dz, h_full[rows], weight[cols], rows, cols)
        return _finish_grads(grad_h, grad_w, hidden, weight, spec) + none


def _log_prob_tile_stats(h_full, weight, tokens, keep_mask, scale, spec: _vocab.OpSpec) -> tuple[RowStats, torch.Tensor]:
    """This rank's running statistics over its logits tiles (target apart) and its target logits
    (0 where another rank owns the target)."""
    n_rows = h_full.size(0)
    dtype = _vocab.compute_dtype(h_full.dtype)
    cols, owned = _vocab.local_columns(tokens, spec.first_id, spec.n_valid)
    stats = RowStats(n_rows, dtype, h_full.device, moment=spec.with_entropy, subset=keep_mask is not None)
    x_target = torch.zeros(n_rows, dtype=dtype, device=h_full.device)
    for rows, tile_cols, x in _tile_loop(h_full, weight, spec, dtype):
        local, inside = _column_marks(cols[rows], owned[rows], tile_cols.start, x.size(1))
        marked = _marks(x, local[:, None], inside[:, None])
        x_target[rows] += torch.where(inside, x.gather(1, local[:, None]).squeeze(1), 0.0)
        subset = keep_mask[rows, tile_cols] if keep_mask is not None else None
        stats.add(rows, x, _vocab.scale_rows(scale, rows), marked, subset, torch.empty_like(x))
    return stats, x_target


@dataclass
class _LogProbRows:
    """Per-row inputs of the log-prob/entropy backward: the saved statistics (kept-id shift and
    log-sum are the full ones without a mask), a = s·dL/dlogp and b = s·dL/dH (None: no gradient)."""

    shift: torch.Tensor
    log_s: torch.Tensor
    mean: Optional[torch.Tensor]
    shift_kept: torch.Tensor
    log_s_kept: torch.Tensor
    a: Optional[torch.Tensor]
    b: Optional[torch.Tensor]
    keep_mask: Optional[torch.Tensor]
    cols: torch.Tensor  # local target columns
    owned: torch.Tensor  # whether this rank holds the target


def _log_prob_rows(stats, grad_log_probs, grad_entropy, scale, tokens, keep_mask, spec: _vocab.OpSpec) -> _LogProbRows:
    s_row = scale.squeeze(1) if isinstance(scale, torch.Tensor) else scale
    saved = list(stats.unbind(0))
    shift, log_s = saved[0], saved[1]
    shift_kept, log_s_kept = (saved[-2], saved[-1]) if keep_mask is not None else (shift, log_s)
    cols, owned = _vocab.local_columns(tokens, spec.first_id, spec.n_valid)
    return _LogProbRows(
        shift=shift, log_s=log_s, mean=saved[2] if spec.entropy_grad else None,
        shift_kept=shift_kept, log_s_kept=log_s_kept,
        a=grad_log_probs.to(stats.dtype) * s_row if grad_log_probs is not None else None,
        b=grad_entropy.to(stats.dtype) * s_row if grad_entropy is not None else None,
        keep_mask=keep_mask, cols=cols, owned=owned,
    )


def _log_prob_tile_grad(x: torch.Tensor, rows: slice, cols: slice, tile_scale, row: _LogProbRows) -> torch.Tensor:
    """dL/dz of one logits tile: a·(onehot − p_kept) − b·p·(log p + H), target entries exact."""
    shifted = (x - row.shift[rows, None]) * tile_scale
    dz = torch.zeros_like(x)
    if row.b is not None:  # -b·p·(log p + H) = -b·p·(u - Ā)
        probs = torch.exp(shifted - row.log_s[rows, None])
        dz -= row.b[rows, None] * probs * (shifted.clamp_min(_vocab.NEG_FLOOR) - row.mean[rows, None])
    if row.a is not None:  # -a·p_kept on the kept ids (the target entry is rewritten below)
        masked = row.keep_mask is not None
        shifted_kept = shifted if not masked else (x - row.shift_kept[rows, None]) * tile_scale
        probs_kept = torch.exp(shifted_kept - row.log_s_kept[rows, None])
        if masked:
            probs_kept = probs_kept.masked_fill_(~row.keep_mask[rows, cols], 0.0)
        dz -= row.a[rows, None] * probs_kept
        _write_target_entries(dz, shifted, shifted_kept, rows, cols.start, row)
    return dz


def _write_target_entries(dz, shifted, shifted_kept, rows: slice, first_col: int, row: _LogProbRows) -> None:
    """The target entries of a tile (where it holds them), a·(1 - p_kept) as -a·expm1(log p_kept):
    exact for confident tokens; minus b·p·(u - Ā) with an entropy gradient."""
    local, inside = _column_marks(row.cols[rows], row.owned[rows], first_col, dz.size(1))
    log_p_target = shifted_kept.gather(1, local[:, None]).squeeze(1) - row.log_s_kept[rows]
    exact = row.a[rows] * -torch.expm1(log_p_target)
    if row.b is not None:
        u_target = shifted.gather(1, local[:, None]).squeeze(1)
        p_target = torch.exp(u_target - row.log_s[rows])
        exact = exact - row.b[rows] * torch.where(p_target > 0, p_target * (u_target - row.mean[rows]), 0.0)
    _replace_at(dz, local[:, None], inside[:, None], exact[:, None])


def _finish_grads(grad_h, grad_w, hidden, weight, spec):
    if grad_h is not None:
        grad_h = _reduce_rows(grad_h, spec).to(hidden.dtype)
    return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None)


def _global_shifts(shifts: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[c, T] per-row shifts of this rank -> (global maxima, the same with non-finite values
    replaced by 0, this rank's own); `shifts` is reduced in place."""
    local = shifts.clone()
    # MAX all-reduce over the tensor-parallel group: each rank's running maxima over its vocab
    # shard give the full-vocab maxima, the shifts every rank's sums are moved to
    _dist.all_reduce_max_(shifts, group)
    safe = torch.where(torch.isfinite(shifts), shifts, 0.0)
    return shifts, safe, local


def _combine(stats: RowStats, marked_x: torch.Tensor, scale, spec: _vocab.OpSpec, masked: bool) -> dict:
    """Every rank's statistics rescaled to the global shifts: one MAX and one SUM all-reduce."""
    s_row = scale.squeeze(1) if isinstance(scale, torch.Tensor) else scale
    shifts, safe, local = _global_shifts(torch.stack([stats.shift] + ([stats.sub_shift] if masked else [])), spec.group)
    delta = torch.where(torch.isfinite(local), (local - safe) * s_row, -math.inf)
    factor = delta.exp()
    delta0 = torch.where(torch.isfinite(delta[0]), delta[0], 0.0)
    sums = [stats.rest * factor[0]]
    if stats.moment is not None:
        sums.append(factor[0] * (stats.moment + stats.rest * delta0))
    if masked:
        sums.append(stats.sub_sum * factor[1])
    summed = torch.cat([torch.stack(sums), marked_x.reshape(1, -1) if marked_x.dim() == 1 else marked_x.t()])
    # SUM all-reduce over the tensor-parallel group: the partial sums over each rank's vocab
    # shard (moved to the global shifts) add up to full-vocab sums; the target logit, 0 on the
    # ranks not owning it, comes back from its owner
    _dist.all_reduce_sum_(summed, spec.group)
    return _log_prob_outputs(summed, shifts[0], safe, s_row, len(sums), stats.moment is not None, masked)


def _log_prob_outputs(summed, raw_max, safe, s_row, n_sums: int, with_moment: bool, masked: bool) -> dict:
    """Log-probs, entropy mean and the statistics backward keeps, from the combined sums."""
    rest = summed[0]
    x_t = summed[n_sums]
    u_t = (x_t - safe[0]) * s_row
    log_s = torch.logaddexp(rest.log(), u_t)  # S = S_other + e^u_t: log p stays exact as p -> 1
    out = {"raw_max": raw_max, "shift": safe[0], "log_s": log_s, "log_p": u_t - log_s}
    if with_moment:
        p_t = out["log_p"].exp()
        out["mean"] = summed[1] * (-log_s).exp() + torch.where(p_t > 0, p_t * u_t, 0.0)
    if masked:
        u_kt = (x_t - safe[1]) * s_row
        out["shift_kept"] = safe[1]
        out["log_s_kept"] = torch.logaddexp(summed[n_sums - 1].log(), u_kt)
        out["log_p_kept"] = u_kt - out["log_s_kept"]
    return out


def lm_head_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    sequence_parallel: bool = False,
    temperature: float | torch.Tensor = 1.0,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
    keep_mask: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`log_probs_and_entropy(hidden @ weight.T, tokens, ...)` without the logits.

    hidden [T, H] (under `sequence_parallel` this rank's [T/tp, H] rows, gathered inside), weight
    this rank's vocab shard [V_local, H] (the output layer's, or the tied embedding), tokens [T]
    global ids of every row. Gradients flow to hidden and weight. `chunk_size`: rows per tile
    (None: a byte budget). Outputs fp32 (fp64 for fp64 inputs); entropy None unless `with_entropy`.
    """
    _, n_rows, vocab = _check_common(hidden, weight, tp_group, sequence_parallel, vocab_size, chunk_size)
    checks = _vocab.DeviceChecks()
    _vocab.check_tokens_shape(tokens, n_rows, hidden.device, "(all rows, also under sequence parallelism)", "hidden")
    _vocab.require_tokens_in_vocab(tokens, vocab, checks)
    tau = _vocab.check_temperature(temperature, (n_rows,), hidden.device, checks, hidden.dtype)
    _vocab.check_keep_mask(keep_mask, (n_rows, weight.size(0)), hidden.device, "hidden rows x weight rows")
    spec = _spec(hidden, weight, tp_group, sequence_parallel, vocab, chunk_size, "lm_head_log_probs_and_entropy",
                 with_entropy=bool(with_entropy), entropy_grad=bool(with_entropy and entropy_requires_grad))
    log_probs, entropy = _LMHeadLogProbs.apply(hidden, weight, tokens, keep_mask, tau, spec, checks)
    return log_probs, (entropy if with_entropy else None)


# ----------------------------------------------------------------------------- top-k


def _sortable(x: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as the fp32 values (−0 = +0), for exact (value desc, id asc) selection."""
    bits = (x.float() + 0.0).view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


_ID_BITS = 32
_ID_MASK = (1 << _ID_BITS) - 1


def lm_head_topk_ids(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    sequence_parallel: bool = False,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """`topk_ids(hidden @ weight.T, k, ...)` without the logits: global ids [T, k] of the k largest
    logits per row, descending, ties to the lower id; no gradient. A positive temperature does
    not change the order (accepted for symmetry with `lm_head_topk_logprobs`). Each rank keeps a
    running top-k per row tile; ranks all-gather k candidates each (O(T·k·tp))."""
    from megatron_rl_patches.ops.topk import _check_int_k, _check_k

    _, n_rows, vocab = _check_common(hidden, weight, tp_group, sequence_parallel, vocab_size, chunk_size)
    k = _check_int_k(k)
    _check_k(k, vocab)
    checks = _vocab.DeviceChecks()
    _vocab.check_temperature(temperature, (n_rows,), hidden.device, checks, hidden.dtype)
    if hidden.dtype == torch.float64:
        raise TypeError("lm_head_topk_ids ranks fp32/bf16/fp16 logits; for fp64 inputs use topk_ids(hidden @ weight.T, k)")
    spec = _spec(hidden, weight, tp_group, sequence_parallel, vocab, chunk_size, "lm_head_topk_ids")
    with torch.no_grad():
        best, row_max = _running_topk_keys(_gather_rows(hidden.detach(), spec), weight.detach(), k, spec)
        # MAX all-reduce over the tensor-parallel group of the local row maxima: the full-vocab
        # max tells rows with NaN/+inf or without any finite logit apart on every rank alike
        _dist.all_reduce_max_(row_max, spec.group)
        bad = _vocab.bad_row_codes(row_max)
        checks.require(bad == 0, lambda: _vocab.bad_rows_error(spec.op, spec.arg, bad))
        checks.raise_first()  # the call's one host sync
        # all-gather over the tensor-parallel group of every rank's k best keys per row
        # (O(T·k·tp)): the k best of them are the global top-k, the same on every rank
        best = torch.topk(_dist.all_gather_last_dim(best, spec.group), k, dim=1).values
        return _ID_MASK - (best & _ID_MASK)


def _running_topk_keys(h_full, weight, k: int, spec: _vocab.OpSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's k best (value, id) keys per row over its logits tiles, and its row max (NaN
    as +inf)."""
    n_rows = h_full.size(0)
    best = torch.full((n_rows, k), torch.iinfo(torch.int64).min, dtype=torch.int64, device=h_full.device)
    row_max = torch.full((n_rows,), -math.inf, device=h_full.device)
    for rows, cols, x in _tile_loop(h_full, weight, spec, torch.float32):
        ids = torch.arange(cols.start, cols.stop, device=x.device) + spec.first_id
        keys = (_sortable(x) << _ID_BITS) | (_ID_MASK - ids)  # larger key: larger value, then lower id
        take = min(k, keys.size(1))
        candidates = torch.cat([best[rows], torch.topk(keys, take, dim=1).values], dim=1)
        best[rows] = torch.topk(candidates, k, dim=1).values
        tile_max = x.amax(dim=1)
        row_max[rows] = torch.maximum(row_max[rows], torch.where(torch.isnan(tile_max), math.inf, tile_max))
    return best, row_max


class _LMHeadTopk(torch.autograd.Function):
    """(log p at ids [T, k], log tail mass [T]) over the full vocab, from hidden states. The tail
    (columns not in ids) is summed with its own max as shift: exact down to any mass."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, tau, spec: _vocab.OpSpec, checks):  # type: ignore[override]
        h_full = _gather_rows(hidden, spec)
        scale = _vocab.row_scale(tau, ids.size(0), _vocab.compute_dtype(hidden.dtype))
        stats, x_ids = _topk_tile_stats(h_full, weight, ids, scale, spec)
        out = _combine_topk(stats, x_ids, scale, spec)
        bad = _vocab.bad_row_codes(out["raw_max"])
        checks.require(bad == 0, lambda: _vocab.bad_rows_error(spec.op, spec.arg, bad))
        checks.raise_first()
        ctx.spec, ctx.tensor_tau = spec, isinstance(tau, torch.Tensor)
        ctx.tau = None if ctx.tensor_tau else tau
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, ids, torch.stack([out["shift"], out["log_sum"], out["tail_shift"],
                                                                out["log_tail_sum"]]), tau if ctx.tensor_tau else None)
        return out["logp"], out["tail"]

    @staticmethod
    @_vocab.reject_double_backward
    def backward(ctx, grad_logp, grad_tail):  # type: ignore[override]
        hidden, weight, ids, stats, tau = ctx.saved_tensors
        spec: _vocab.OpSpec = ctx.spec
        none = (None,) * 4
        if (grad_logp is None and grad_tail is None) or not any(ctx.needs_input_grad[:2]):
            return (None, None) + none
        h_full = _gather_rows(hidden, spec)
        scale = _vocab.row_scale(tau if ctx.tensor_tau else ctx.tau, ids.size(0), stats.dtype)
        row = _topk_rows(stats, grad_logp, grad_tail, ids, spec)
        grad_h, grad_w = _accumulators(hidden, weight, h_full.size(0), ctx.needs_input_grad[:2])
        for rows, cols, x in _tile_loop(h_full, weight, spec, stats.dtype):
            dz = _topk_tile_grad(x, rows, cols.start, _vocab.scale_rows(scale, rows), row)
            _accumulate(grad_h, grad_w, dz, h_full[rows], weight[cols], rows, cols)
        return _finish_grads(grad_h, grad_w, hidden, weight, spec) + none


def _topk_tile_stats(h_full, weight, ids, scale, spec: _vocab.OpSpec) -> tuple[RowStats, torch.Tensor]:
    """This rank's running statistics over its logits tiles (the tail: every column not in ids)
    and its logits at the ids (0 where another rank owns them)."""
    n_rows, k = ids.shape
    dtype = _vocab.compute_dtype(h_full.dtype)
    cols, owned = _vocab.local_columns(ids, spec.first_id, spec.n_valid)
    stats = RowStats(n_rows, dtype, h_full.device, moment=False, subset=True)
    x_ids = torch.zeros(n_rows, k, dtype=dtype, device=h_full.device)
    for rows, tile_cols, x in _tile_loop(h_full, weight, spec, dtype):
        local, inside = _column_marks(cols[rows], owned[rows], tile_cols.start, x.size(1))
        marked = _marks(x, local, inside)
        x_ids[rows] += torch.where(inside, x.gather(1, local), 0.0)
        stats.add(rows, x, _vocab.scale_rows(scale, rows), marked, ~marked, torch.empty_like(x))
    return stats, x_ids


@dataclass
class _TopkRows:
    """Per-row inputs of the top-k backward: saved statistics, the incoming gradients (`grad_tail`
    0 for an empty tail, a constant) and their sum `total`; the ids' local columns."""

    shift: torch.Tensor
    log_sum: torch.Tensor
    tail_shift: torch.Tensor
    log_tail_sum: torch.Tensor
    grad_ids: torch.Tensor
    grad_tail: Optional[torch.Tensor]
    total: torch.Tensor
    cols: torch.Tensor
    owned: torch.Tensor


def _topk_rows(stats, grad_logp, grad_tail, ids, spec: _vocab.OpSpec) -> _TopkRows:
    shift, log_sum, tail_shift, log_tail_sum = stats.unbind(0)
    grad_ids = grad_logp.to(stats.dtype) if grad_logp is not None else stats.new_zeros(ids.shape)
    tail_finite = torch.isfinite(log_tail_sum)  # an empty tail is a constant: no gradient
    g_tail = torch.where(tail_finite, grad_tail.to(stats.dtype), 0.0) if grad_tail is not None else None
    total = grad_ids.sum(dim=1) + (g_tail if g_tail is not None else 0.0)
    cols, owned = _vocab.local_columns(ids, spec.first_id, spec.n_valid)
    return _TopkRows(shift, log_sum, tail_shift, log_tail_sum, grad_ids, g_tail, total, cols, owned)


def _topk_tile_grad(x: torch.Tensor, rows: slice, first_col: int, tile_scale, row: _TopkRows) -> torch.Tensor:
    """dL/dx of one logits tile: dlogp_i/dz_j = [i==j] - p_j ; dtail/dz_j = [j in tail]·p_j/P_tail
    - p_j ; dz/dx = 1/τ."""
    probs = torch.exp((x - row.shift[rows, None]) * tile_scale - row.log_sum[rows, None])
    dz = probs * -row.total[rows, None]
    local, inside = _column_marks(row.cols[rows], row.owned[rows], first_col, x.size(1))
    if row.grad_tail is not None:
        in_ids = _marks(x, local, inside)
        tail_probs = torch.exp((x - row.tail_shift[rows, None]) * tile_scale - row.log_tail_sum[rows, None])
        dz += torch.where(in_ids, 0.0, tail_probs * row.grad_tail[rows, None])
    _replace_at(dz, local, inside, row.grad_ids[rows] - probs.gather(1, local) * row.total[rows, None])
    dz *= tile_scale
    return dz


def _combine_topk(stats: RowStats, x_ids: torch.Tensor, scale, spec: _vocab.OpSpec) -> dict:
    """Every rank's tail sums rescaled to the global shifts: one MAX and one SUM all-reduce."""
    s_col = scale  # [T, 1] or a float
    s_row = scale.squeeze(1) if isinstance(scale, torch.Tensor) else scale
    shifts, safe, local = _global_shifts(torch.stack([stats.shift, stats.sub_shift]), spec.group)
    factor = torch.where(torch.isfinite(local[1]), ((local[1] - safe[1]) * s_row).exp(), 0.0)
    summed = torch.cat([(stats.sub_sum * factor)[:, None], x_ids], dim=1)
    # SUM all-reduce over the tensor-parallel group: the tail sums over each rank's vocab shard
    # add up to the full tail; the ids' logits, 0 on the ranks not owning them, come back from
    # their owners
    _dist.all_reduce_sum_(summed, spec.group)
    u_ids = (summed[:, 1:] - safe[0][:, None]) * s_col
    tail_offset = (safe[1] - safe[0]) * s_row
    log_tail_sum = summed[:, 0].log()
    log_sum = torch.logaddexp(log_tail_sum + tail_offset, torch.logsumexp(u_ids, dim=1))
    return {"raw_max": shifts[0], "shift": safe[0], "log_sum": log_sum, "tail_shift": safe[1],
            "log_tail_sum": log_tail_sum, "logp": u_ids - log_sum[:, None],
            "tail": tail_offset + log_tail_sum - log_sum}


def lm_head_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    sequence_parallel: bool = False,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_logprobs(hidden @ weight.T, ids, ...)` without the logits: log-probs at ids [T, k]
    normalized over the full vocab, and the log of the remaining mass [T] (the complement's own
    log-sum-exp, never log(1 − Σp)). Gradients flow to hidden and weight (a student); call under
    no_grad for a teacher."""
    from megatron_rl_patches.ops.topk import _check_ids

    _, n_rows, vocab = _check_common(hidden, weight, tp_group, sequence_parallel, vocab_size, chunk_size)
    checks = _vocab.DeviceChecks()
    k = _check_ids(ids, torch.Size([n_rows]), vocab, checks)
    tau = _vocab.check_temperature(temperature, (n_rows,), hidden.device, checks, hidden.dtype)
    spec = _spec(hidden, weight, tp_group, sequence_parallel, vocab, chunk_size, "lm_head_topk_logprobs")
    flat = ids.reshape(n_rows, k).to(device=hidden.device, dtype=torch.long)
    return _LMHeadTopk.apply(hidden, weight, flat, tau, spec, checks)
