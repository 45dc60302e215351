"""The two autograd Functions of every vocabulary op, over either source (logits, or hidden states
with an output-weight shard) and any backend: forward = backend statistics, combine over ranks,
finalize; backward = gradient factors, backend gradients. Nothing [T, V]-sized is kept: the
source's tensors and a few numbers per token (see :mod:`._stats`).
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.ops import _checks, _dist, _stats, _vocab
from megatron_rl_patches.ops._rows import scatter_rows, take_rows
from megatron_rl_patches.ops.kernels import Backend
from megatron_rl_patches.ops.kernels.sources import Source, gather_rows, reduce_rows


def save_tau(ctx: Any, tau: float | torch.Tensor) -> torch.Tensor | None:
    """Keep a float temperature on `ctx`; return a tensor one for save_for_backward (else None)."""
    ctx.tau = None if isinstance(tau, torch.Tensor) else tau
    return tau if isinstance(tau, torch.Tensor) else None


def saved_scale(ctx: Any, tau_tensor: torch.Tensor | None, n_rows: int, dtype: torch.dtype) -> float | torch.Tensor:
    """The backward's 1/τ from what :func:`save_tau` kept."""
    return _stats.row_scale(tau_tensor if tau_tensor is not None else ctx.tau, n_rows, dtype)


def _source(spec: _vocab.OpSpec, tensors: tuple[torch.Tensor, ...], rows: torch.Tensor | None) -> Source:
    """The op's source over the selected `rows` (None: every row). Logits rows are copied out
    (the copy is private, so its storage takes the gradient); hidden rows are gathered under
    sequence parallelism first, then selected, and tiled as for every row (the same bits)."""
    if len(tensors) == 1:
        if rows is not None:
            return Source(spec.n_valid, spec.chunk_rows, logits=tensors[0].index_select(0, rows), inplace=True)
        return Source(spec.n_valid, spec.chunk_rows, logits=tensors[0], inplace=spec.inplace_backward)
    hidden, weight = tensors
    gathered = gather_rows(hidden, spec.group, spec.sequence_parallel)
    return Source(spec.n_valid, spec.chunk_rows, hidden=take_rows(gathered, rows), weight=weight,
                  shape_rows=gathered.size(0))


def _finish(grads: tuple[torch.Tensor | None, ...], tensors: tuple[torch.Tensor, ...],
            spec: _vocab.OpSpec, rows: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Gradients in the inputs' dtypes, the unselected rows' zero; dL/dh summed over the
    tensor-parallel ranks."""
    if len(tensors) == 1:
        return grads if rows is None or grads[0] is None else (_logits_grad_rows(tensors[0], grads[0], rows, spec),)
    grad_h, grad_w = grads
    if grad_h is not None:
        grad_h = scatter_rows(grad_h, rows, _all_rows(spec, tensors))
        grad_h = reduce_rows(grad_h, spec.group, spec.sequence_parallel).to(tensors[0].dtype)
    return grad_h, (grad_w.to(tensors[1].dtype) if grad_w is not None else None)


def _logits_grad_rows(logits: torch.Tensor, grad: torch.Tensor, rows: torch.Tensor,
                      spec: _vocab.OpSpec) -> torch.Tensor:
    """The selected rows' logits gradient in a [T, V_local] one (zero elsewhere): the logits' own
    storage with `inplace_backward`, else a fresh tensor."""
    if spec.inplace_backward:
        torch.autograd.graph.increment_version(logits)
        full = logits.detach()
        unselected = torch.ones(full.size(0), dtype=torch.bool, device=full.device).index_fill_(0, rows, False)
        full.masked_fill_(unselected[:, None], 0.0)
    else:
        full = torch.zeros_like(logits)
    return full.index_copy_(0, rows, grad.to(full.dtype))


# the Functions' arguments before the source tensors: targets, mask, τ, spec, checks, backend, rows
_N_OPTIONS = 7


def _all_rows(spec: _vocab.OpSpec, tensors: tuple[torch.Tensor, ...]) -> int:
    """Rows of the op's outputs: every (gathered) row, selected or not."""
    return tensors[0].size(0) * (_dist.tp_size(spec.group) if spec.sequence_parallel else 1)


def _check_rows(shift: torch.Tensor, spec: _vocab.OpSpec, checks: _checks.DeviceChecks, rows: torch.Tensor | None,
                n_rows: int, kept_log_sum: torch.Tensor | None = None) -> None:
    """Bad rows among the selected ones join the call's checks, then its one host sync."""
    _checks.require_good_rows(checks, shift, spec.op, spec.arg, kept_log_sum=kept_log_sum, rows=rows, n_rows=n_rows)
    checks.raise_first()  # the call's one host sync: input checks and bad rows at once


class LogProbEntropy(torch.autograd.Function):
    """log p(target) (over the kept ids when masked) and entropy H of softmax(x/τ)."""

    @staticmethod
    def forward(ctx, tokens, keep_mask, tau, spec: _vocab.OpSpec, checks, backend: Backend, rows, *tensors):
        """`rows`: the selected rows (None: all); tokens, keep_mask and a per-row τ are theirs."""
        source = _source(spec, tensors, rows)
        n_rows = _all_rows(spec, tensors)
        dtype = _stats.compute_dtype(source.first.dtype)
        masked = keep_mask is not None
        scale = _stats.row_scale(tau, source.n_rows, dtype)
        cols, owned = _vocab.local_columns(tokens, spec.first_id, spec.n_valid)
        stats = _stats.RowStats.empty(source.n_rows, 1, dtype, source.first.device, moment=spec.with_entropy,
                                      subset=masked)
        stats = backend.combined_stats(source, stats, cols[:, None], owned[:, None], keep_mask, scale, spec.group)
        out, entropy = backend.finalize(_log_prob_finalize, source.n_rows, stats, scale, spec.with_entropy)
        assert out.log_probs is not None and out.shift is not None and out.log_s is not None  # computed here
        _check_rows(stats.shift, spec, checks, rows, n_rows, out.log_s_kept if masked else None)
        entropy = entropy if entropy is not None else out.log_probs.new_empty(0)
        # what backward reads: the kept shift and log-sum always; the full ones and Ā with an
        # entropy gradient or without a mask (≤ 20 B/token)
        full = spec.entropy_grad or not masked
        saved = [out.shift, out.log_s] if full else []
        if spec.entropy_grad:
            assert out.mean is not None  # an entropy gradient comes with the entropy's moment
            saved.append(out.mean)
        if masked:
            saved += [out.shift_kept, out.log_s_kept]
        ctx.spec, ctx.masked, ctx.backend, ctx.n_tensors = spec, masked, backend, len(tensors)
        ctx.set_materialize_grads(False)
        # int32 local target column (-1: another rank owns it), not int64 ids
        ctx.save_for_backward(*tensors, torch.where(owned, cols, -1).to(torch.int32), torch.stack(saved), keep_mask,
                              save_tau(ctx, tau), rows)
        entropy = scatter_rows(entropy, rows, n_rows) if spec.with_entropy else entropy
        if not spec.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return scatter_rows(out.log_probs, rows, n_rows), entropy

    @staticmethod
    @_vocab.reject_double_backward
    def backward(ctx, grad_log_probs, grad_entropy):
        *tensors, target_cols, saved, keep_mask, tau, rows = ctx.saved_tensors
        spec: _vocab.OpSpec = ctx.spec
        none = (None,) * _N_OPTIONS
        grad_entropy = grad_entropy if spec.entropy_grad else None
        if (grad_log_probs is None and grad_entropy is None) or not any(ctx.needs_input_grad[_N_OPTIONS:]):
            return none + (None,) * ctx.n_tensors
        grad_log_probs, grad_entropy = take_rows(grad_log_probs, rows), take_rows(grad_entropy, rows)
        source = _source(spec, tuple(tensors), rows)
        scale = saved_scale(ctx, tau, source.n_rows, saved.dtype)
        out = _saved_log_prob_outputs(list(saved.unbind(0)), spec.entropy_grad, ctx.masked)
        factors = _stats.log_prob_grad_factors(out, grad_log_probs, grad_entropy, scale,
                                               target_cols.long().clamp_min(0), target_cols >= 0, ctx.masked)
        grads = ctx.backend.apply_grad(source, factors, scale, keep_mask if ctx.masked else None,
                                       tuple(ctx.needs_input_grad[_N_OPTIONS:]))
        return none + _finish(grads, tuple(tensors), spec, rows)


def _log_prob_finalize(stats: _stats.RowStats, scale: float | torch.Tensor,
                       with_entropy: bool) -> tuple[_stats.LogProbOutputs, torch.Tensor | None]:
    """The log-prob outputs and (when asked) the entropy of combined statistics."""
    out = _stats.log_prob_outputs(stats, scale)
    return out, (out.entropy if with_entropy else None)


def _saved_log_prob_outputs(saved: list[torch.Tensor], entropy_grad: bool, masked: bool) -> _stats.LogProbOutputs:
    """The statistics LogProbEntropy saved, back in their named places (absent ones None)."""
    full = entropy_grad or not masked
    shift, log_s = (saved.pop(0), saved.pop(0)) if full else (None, None)
    mean = saved.pop(0) if entropy_grad else None
    shift_kept, log_s_kept = (saved.pop(0), saved.pop(0)) if masked else (shift, log_s)
    assert shift_kept is not None and log_s_kept is not None  # without a mask the full ones were saved
    return _stats.LogProbOutputs(None, shift, log_s, mean, shift_kept, log_s_kept)


class TopkLogprobs(torch.autograd.Function):
    """(log p at ids [T, k], log tail mass [T]) over the full (vocab-parallel) vocabulary. Slots
    where `valid` [T, k] (or None: all) is False are padding: log p -inf, no gradient, their
    columns in the tail."""

    @staticmethod
    def forward(ctx, ids, valid, tau, spec: _vocab.OpSpec, checks, backend: Backend, rows, *tensors):
        """`rows`: the selected rows (None: all); ids, valid and a per-row τ are theirs."""
        source = _source(spec, tensors, rows)
        n_rows = _all_rows(spec, tensors)
        dtype = _stats.compute_dtype(source.first.dtype)
        scale = _stats.row_scale(tau, source.n_rows, dtype)
        cols, owned = _vocab.local_columns(ids, spec.first_id, spec.n_valid, valid)
        stats = _stats.RowStats.empty(source.n_rows, ids.size(1), dtype, source.first.device, rest=False, subset=True)
        stats = backend.combined_stats(source, stats, cols, owned, None, scale, spec.group)
        _check_rows(stats.shift, spec, checks, rows, n_rows)
        out = backend.finalize(_stats.topk_outputs, source.n_rows, stats, scale, valid)
        ctx.spec, ctx.backend, ctx.n_tensors = spec, backend, len(tensors)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors, ids, valid, torch.stack([out.shift, out.log_sum, out.tail_shift,
                                                                 out.log_tail_sum]), save_tau(ctx, tau), rows)
        assert out.tail is not None  # computed here
        return scatter_rows(out.logp, rows, n_rows), scatter_rows(out.tail, rows, n_rows)

    @staticmethod
    @_vocab.reject_double_backward
    def backward(ctx, grad_logp, grad_tail):
        *tensors, ids, valid, saved, tau, rows = ctx.saved_tensors
        spec: _vocab.OpSpec = ctx.spec
        none = (None,) * _N_OPTIONS
        if (grad_logp is None and grad_tail is None) or not any(ctx.needs_input_grad[_N_OPTIONS:]):
            return none + (None,) * ctx.n_tensors
        grad_logp, grad_tail = take_rows(grad_logp, rows), take_rows(grad_tail, rows)
        source = _source(spec, tuple(tensors), rows)
        scale = saved_scale(ctx, tau, source.n_rows, saved.dtype)
        shift, log_sum, tail_shift, log_tail_sum = saved.unbind(0)
        out = _stats.TopkOutputs(torch.zeros(ids.shape, dtype=saved.dtype, device=saved.device), None, shift, log_sum,
                                 tail_shift, log_tail_sum)
        if valid is not None and grad_logp is not None:  # padding: a constant -inf, no gradient
            grad_logp = grad_logp.masked_fill(~valid, 0.0)
        cols, owned = _vocab.local_columns(ids, spec.first_id, spec.n_valid, valid)
        factors = _stats.topk_grad_factors(out, grad_logp, grad_tail, scale, cols, owned)
        grads = ctx.backend.apply_grad(source, factors, scale, None, tuple(ctx.needs_input_grad[_N_OPTIONS:]))
        return none + _finish(grads, tuple(tensors), spec, rows)
