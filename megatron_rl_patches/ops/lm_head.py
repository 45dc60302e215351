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

import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_rl_patches.ops import _checks, _dist, _stats, _vocab, topk_checks, topk_select
from megatron_rl_patches.ops._functions import LogProbEntropy, TopkLogprobs
from megatron_rl_patches.ops._rows import RowSelection, unselected_as
from megatron_rl_patches.ops.invariance import agreed_route
from megatron_rl_patches.ops.kernels import Backend, resolve_backend, topk_step
from megatron_rl_patches.ops.kernels.sources import Source, gather_rows
from megatron_rl_patches.ops.kernels.torch_tiles import tile_shape, tiles
from megatron_rl_patches.ops.scoring_plan import checked_k

__all__ = ["lm_head_log_probs_and_entropy", "lm_head_topk_ids", "lm_head_topk_logprobs"]


# ----------------------------------------------------------------------------- log-probs + entropy

def check_lm_head_inputs(hidden, weight, tp_group, sequence_parallel, vocab_size, chunk_size) -> tuple[int, int, int]:
    """The fused head's (and `lm_head_divergence`'s) shared inputs: (local rows, global rows, global
    vocab); TypeError/ValueError naming the argument."""
    _checks.check_float_tensor(hidden, "hidden", "[T, H] (under sequence parallelism this rank's [T/tp, H])")
    _checks.check_float_tensor(weight, "weight", "[V_local, H] (this rank's vocab shard of the output weight)")
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
    _checks.check_group(tp_group)
    if sequence_parallel and tp_group is None:
        raise ValueError(
            "sequence_parallel=True needs tp_group: the tensor-parallel group whose ranks each hold T/tp rows "
            "of hidden; tp_group=None means no tensor parallelism, where sequence_parallel must be False"
        )
    _checks.check_chunk_size(chunk_size)
    vocab = _checks.global_vocab(weight.size(0), tp_group, vocab_size)
    rows = hidden.size(0) * (_dist.tp_size(tp_group) if sequence_parallel else 1)
    return hidden.size(0), rows, vocab


def _kernels(backend: str | None, hidden: torch.Tensor) -> Callable[[bool], Backend]:
    """The backend an lm-head op runs for a mode (the mode and this choice are agreed together)."""
    return lambda mode: resolve_backend(backend, hidden.device, hidden.dtype, mode)


def lm_head_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    temperature: float | torch.Tensor = 1.0,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
    keep_mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    row_mask: torch.Tensor | None = None,
    invariant: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`log_probs_and_entropy(hidden @ weight.T, tokens, ...)` without the logits.

    hidden [T, H] (under `sequence_parallel` this rank's [T/tp, H] rows, gathered inside), weight
    this rank's vocab shard [V_local, H] (the output layer's, or the tied embedding), tokens [T]
    global ids of every row. Gradients flow to hidden and weight. `chunk_size`: rows per tile
    (None: a byte budget). Outputs fp32 (fp64 for fp64 inputs); entropy None unless `with_entropy`.
    `row_mask` [T] bool (all rows, also under sequence parallelism; the same on every rank): only
    these rows meet the weight — one gather of their hidden rows — the others' outputs are 0 with
    no gradient (dW as if their upstream gradient were 0), and the time follows the selected rows.
    `invariant`: each row's outputs a function of its hidden row and the weight alone, bit for bit
    (fixed-shape GEMM tiles; None: the setting ``MEGATRON_RL_PATCHES_INVARIANT``; see
    docs/train-rollout-agreement.md).
    """
    _, n_rows, vocab = check_lm_head_inputs(hidden, weight, tp_group, sequence_parallel, vocab_size, chunk_size)
    checks = _checks.DeviceChecks()
    _checks.check_tokens_shape(tokens, n_rows, hidden.device, "(all rows, also under sequence parallelism)", "hidden")
    selection = RowSelection.of(row_mask, n_rows, hidden.device, "hidden (all rows)", tp_group)
    _checks.require_tokens_in_vocab(unselected_as(tokens, selection), vocab, checks, tp_group)
    tau = _checks.check_temperature(temperature, (n_rows,), hidden.device, checks, hidden.dtype)
    _checks.check_keep_mask(keep_mask, (n_rows, weight.size(0)), hidden.device, "hidden rows x weight rows")
    invariant, chosen = agreed_route(invariant, "lm_head_log_probs_and_entropy", tp_group, _kernels(backend, hidden),
                                     vocab, match=_checks.collective_values(n_rows, vocab, tau,
                                                                            with_entropy=bool(with_entropy),
                                                                            keep_mask=keep_mask is not None))
    spec = _vocab.head_spec(weight, tp_group, sequence_parallel, vocab, chunk_size, "lm_head_log_probs_and_entropy",
                 with_entropy=bool(with_entropy), entropy_grad=bool(with_entropy and entropy_requires_grad),
                 invariant=invariant)
    log_probs, entropy = LogProbEntropy.apply(selection.take(tokens), selection.take(keep_mask),
                                              selection.take_values(tau), spec, checks, chosen, selection.rows,
                                              hidden, weight)
    return log_probs, (entropy if with_entropy else None)


# ----------------------------------------------------------------------------- top-k


def lm_head_topk_ids(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    row_mask: torch.Tensor | None = None,
    backend: str = "auto",
    invariant: bool | None = None,
) -> torch.Tensor:
    """`topk_ids(hidden @ weight.T, k, ...)` without the logits: global ids [T, k] of the k largest
    logits per row, descending, ties to the lower id; no gradient. A positive temperature does
    not change the order (accepted for symmetry with `lm_head_topk_logprobs`). Each rank keeps a
    running top-k per row tile (:mod:`.topk_select`, as `topk_ids`; exact in every dtype, fp64
    included); ranks all-gather k candidates each (O(T·k·tp)). `row_mask` [T] as in
    `lm_head_log_probs_and_entropy`: unselected rows get ids 0. `backend` as the other ops.
    `invariant`: the logits from fixed-shape GEMM tiles, so each row's ids depend on its hidden
    row alone (the torch tiles, whatever `backend`)."""
    _, n_rows, vocab = check_lm_head_inputs(hidden, weight, tp_group, sequence_parallel, vocab_size, chunk_size)
    k = checked_k(k, vocab=vocab)  # a plan's TopK taken as it is
    checks = _checks.DeviceChecks()
    _checks.check_temperature(temperature, (n_rows,), hidden.device, checks, hidden.dtype)
    invariant, chosen = agreed_route(invariant, "lm_head_topk_ids", tp_group, _kernels(backend, hidden), vocab,
                                     match=_checks.collective_values(n_rows, vocab, k=k))
    spec = _vocab.head_spec(weight, tp_group, sequence_parallel, vocab, chunk_size, "lm_head_topk_ids",
                            invariant=invariant)
    selection = RowSelection.of(row_mask, n_rows, hidden.device, "hidden (all rows)", tp_group)
    rows = selection.rows
    with torch.no_grad():
        h = selection.take(gather_rows(hidden.detach(), spec.group, spec.sequence_parallel))
        dtype = _stats.compute_dtype(hidden.dtype)
        source = Source(spec.n_valid, spec.chunk_rows, hidden=h, weight=weight.detach(), shape_rows=n_rows)
        run = topk_select.RunningTopk.empty(h.size(0), k, dtype, h.device, sentinel=vocab)
        run = topk_step(chosen)(source, run, spec.first_id)
        run = topk_select.over_ranks(run, spec.group)
        _checks.require_good_rows(checks, run.row_max, spec.op, spec.arg, rows=rows, n_rows=n_rows)
        ambiguous = checks.raise_first(read=topk_select.ambiguous_rows(run))  # the call's one host sync
        tied = [row for row, flag in enumerate(ambiguous) if flag]
        if tied:
            def row_tiles(listed: list[int], index: torch.Tensor) -> topk_select.Tiles:
                if chosen.tie_tiles is not None:
                    return chosen.tie_tiles(source, index, dtype)
                return _recomputed_rows(source, listed, index, dtype)

            topk_select.exact_rows(run, tied, row_tiles, spec.first_id, spec.group)
        return selection.scatter(run.ids)


def _recomputed_rows(source: Source, listed: list[int], index: torch.Tensor,
                     dtype: torch.dtype) -> topk_select.Tiles:
    """The logits tiles of the rows `listed` (ascending; `index` on the device) as (positions in
    the list, columns, x): each recomputed in the row tile it had (the same h·Wᵀ call shape, so
    the same bits: a BLAS rounds a row differently with another row count)."""
    assert source.hidden is not None  # fused
    row_tile, _ = tile_shape(source.shape_rows or source.n_rows, source.n_valid, source.hidden.device,
                             source.chunk_rows)
    start = 0
    for chunk, members in itertools.groupby(listed, key=lambda row: row // row_tile):
        stop = start + len(list(members))
        r0 = chunk * row_tile
        part = Source(source.n_valid, source.chunk_rows, hidden=source.hidden[r0: r0 + row_tile],
                      weight=source.weight, shape_rows=source.shape_rows)
        local = index[start:stop] - r0
        for _, cols, x in tiles(part, dtype):
            yield slice(start, stop), cols, x[local]
        start = stop


def lm_head_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    ids_mask: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    row_mask: torch.Tensor | None = None,
    invariant: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_logprobs(hidden @ weight.T, ids, ...)` without the logits: log-probs at ids [T, k]
    normalized over the full vocab, and the log of the remaining mass [T] (the complement's own
    log-sum-exp, never log(1 − Σp)). Gradients flow to hidden and weight (a student); call under
    no_grad for a teacher. `ids_mask` as in `topk_logprobs` (padded slots: -inf, mass in the tail).
    `row_mask` [T] as in `lm_head_log_probs_and_entropy` (unselected rows: 0, no gradient);
    `invariant` as there."""
    _, n_rows, vocab = check_lm_head_inputs(hidden, weight, tp_group, sequence_parallel, vocab_size, chunk_size)
    checks = _checks.DeviceChecks()
    k = topk_checks.check_ids(unselected_as(ids, row_mask), torch.Size([n_rows]), vocab, checks, ids_mask)
    selection = RowSelection.of(row_mask, n_rows, hidden.device, "hidden (all rows)", tp_group)
    tau = _checks.check_temperature(temperature, (n_rows,), hidden.device, checks, hidden.dtype)
    invariant, chosen = agreed_route(invariant, "lm_head_topk_logprobs", tp_group, _kernels(backend, hidden), vocab,
                                     match=_checks.collective_values(n_rows, vocab, tau, k=k,
                                                                     ids_mask=ids_mask is not None))
    spec = _vocab.head_spec(weight, tp_group, sequence_parallel, vocab, chunk_size, "lm_head_topk_logprobs",
                            invariant=invariant)
    flat = ids.reshape(n_rows, k).to(device=hidden.device, dtype=torch.long)
    valid = None if ids_mask is None else ids_mask.reshape(n_rows, k).to(hidden.device)
    return TopkLogprobs.apply(selection.take(flat), selection.take(valid), selection.take_values(tau), spec, checks,
                              chosen, selection.rows, hidden, weight)
