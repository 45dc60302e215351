"""Exact full-vocabulary divergences between a student and one or more teachers, straight from each
model's final hidden states and (vocab-parallel) output weight: no model's [T, V] logits ever
exist, in forward or backward.

Forward, pass 1 walks the vocabulary tiles of every model together (x = h·Wᵀ per tile) and folds
each model's normalizer (running max + Σ e^u: the statistics core's fold); forward / reverse KL
and mixed_kl against one teacher fold their cross terms beside it with the same online rescaling
(one pass). Ranks combine every model's statistics (one MAX and one SUM all-reduce of O(T) per
model, plus one SUM for the cross terms). Every other case needs every normalizer before its terms (the
teachers' mixture, jsd's M, the skews' mixtures, |q − p|): pass 2 recomputes the tiles of every
model and sums the value and the row constants backward needs (one SUM all-reduce). Backward
recomputes the tiles of the student and the teachers (teachers without grad) and accumulates
dL/dh_s and dL/dW_s. A backend with the optional divergence steps (the Triton kernels, one
teacher) takes pass 2 and the backward's tiles
(:class:`~megatron_rl_patches.ops.kernels.DivergenceKernels`). In T·H·V/tp matmuls with n
teachers: one pass 2 forward + 4 backward (dense: 4); two passes 2(1+n) forward + (1+n) + 2
backward (dense: (1+n) + 2); memory per rank and the choice against top-k in docs/distillation.md ("Full vocabulary").
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.ops import _checks, _dist, _stats, _vocab, divergence_checks
from megatron_rl_patches.ops import _divergence_tiles as tiles_math
from megatron_rl_patches.ops._divergences import DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_DIVERGENCE, ResolvedDivergence
from megatron_rl_patches.ops._functions import save_tau, saved_scale
from megatron_rl_patches.ops._rows import RowSelection, scatter_rows, take_rows
from megatron_rl_patches.ops.agreement import Value
from megatron_rl_patches.ops.invariance import VARIABLE, agreed_invariant
from megatron_rl_patches.ops.kernels import Backend, divergence_step, resolve_backend
from megatron_rl_patches.ops.kernels.sources import Source, gather_rows, reduce_rows
from megatron_rl_patches.ops.kernels.torch_tiles import accumulate, tiles
from megatron_rl_patches.ops.lm_head import check_lm_head_inputs

__all__ = ["lm_head_divergence"]

Tensors = torch.Tensor | Sequence[torch.Tensor]


def lm_head_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: Tensors,
    teacher_weight: Tensors,
    *,
    divergence: str = DEFAULT_DIVERGENCE,
    beta: float = DEFAULT_BETA,
    alpha: float = DEFAULT_ALPHA,
    teacher_weights: torch.Tensor | Sequence[float] | None = None,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    keep_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    row_mask: torch.Tensor | None = None,
    invariant: bool | None = None,
) -> torch.Tensor:
    """Per-token divergence [T] between the student's softmax(h·Wᵀ/τ) and the teachers' mixture.

    hidden [T, H_s] and weight [V_local, H_s]: the student (under `sequence_parallel` this rank's
    [T/tp, H_s] rows, gathered inside); teacher_hidden [T, H_t] and teacher_weight [V_local, H_t]
    one teacher, or equal-length sequences of them mixed in probability space with
    `teacher_weights`, the mixture's probabilities (≥ 0, summing to 1 within 1e-6, never
    renormalized; None: equal; the same policy as `topk_kl`). Every model shares the vocabulary, its TP
    sharding and `temperature` (a float or per-token [T]). `divergence`: forward_kl = KL(q‖p_s),
    reverse_kl = KL(p_s‖q), jsd (β), skew_forward_kl / skew_reverse_kl (α), tv (see
    :mod:`megatron_rl_patches.ops._divergences`). `keep_mask` [T, V_local] bool: every model's
    distribution renormalized over the kept ids, the divergence between those. Gradients flow to
    hidden and weight only; outputs fp32 (fp64 for fp64 inputs). `chunk_size`: rows per tile.
    `backend` ("auto", "torch", "triton"; as the other vocabulary ops): with "triton" and one
    teacher of the student's dtype (not fp64) pass 2 and the backward are kernels (the table's
    terms on tiles recomputed in registers), and every model's normalizer is folded by the
    kernels when the divergence needs a second pass and no keep_mask; the one-pass KLs' pass 1,
    the masked pass 1 and the teachers' mixture run on torch tiles.
    `row_mask` [T] bool (the gathered rows under sequence parallelism; the same on every rank):
    only the selected rows meet the weights; the others' divergence is 0 with no gradient.
    `invariant=True` is refused (this op's sums are not yet exact in any order): for invariant
    distillation use `lm_head_topk_logprobs(..., invariant=True)` and `topk_kl(..., invariant=True)`;
    when the setting or a config asks for the mode, this op runs in the default mode with a warning.
    """
    _, n_rows, vocab = check_lm_head_inputs(hidden, weight, tp_group, sequence_parallel, vocab_size, chunk_size)
    name, beta, alpha = divergence_checks.check_divergence_options(divergence, beta, alpha)
    checks = _checks.DeviceChecks()
    teachers = divergence_checks.check_teacher_models(teacher_hidden, teacher_weight, hidden, weight, checks)
    dtype = _stats.compute_dtype(hidden.dtype)
    log_w = _checks.check_weights(teacher_weights, len(teachers), dtype, hidden.device, checks)
    tau = _checks.check_temperature(temperature, (n_rows,), hidden.device, checks, hidden.dtype)
    _checks.check_keep_mask(keep_mask, (n_rows, weight.size(0)), hidden.device, "hidden rows x weight rows")
    _refuse_invariant(invariant, tp_group, _checks.collective_values(
        n_rows, vocab, tau, divergence=f"{name} (beta {beta}, alpha {alpha})", teachers=len(teachers),
        keep_mask=keep_mask is not None))
    spec = _vocab.head_spec(weight, tp_group, sequence_parallel, vocab, chunk_size, "lm_head_divergence")
    plan = ResolvedDivergence.of(name, beta, alpha)
    chosen = resolve_backend(backend, hidden.device, hidden.dtype)
    selection = RowSelection.of(row_mask, n_rows, hidden.device, "the (gathered) hidden rows", tp_group)
    flat = [t.detach() for pair in teachers for t in pair]  # teachers get no gradient
    value = LmHeadDivergence.apply((plan, chosen, selection.rows), spec, checks, selection.take(keep_mask),
                                   selection.take_values(tau), log_w, hidden, weight, *flat)
    return selection.scatter(value)


def _refuse_invariant(invariant: object, group: dist.ProcessGroup | None, match: dict[str, Value]) -> None:
    """This op has no invariant mode yet: an explicit request is an error, the setting a warning.
    The mode is agreed over the group with `match` (the values that must be the same on every rank)."""
    if invariant is True:
        raise ValueError("lm_head_divergence(invariant=True) is not supported: its divergence sums are not exact in "
                         "any order yet; use lm_head_topk_logprobs(..., invariant=True) with topk_kl(..., "
                         "invariant=True), or invariant=False")
    if agreed_invariant(invariant, "lm_head_divergence", group, match=match):
        warn_once(f"lm_head_divergence has no invariant mode yet: it runs in the default mode although {VARIABLE} "
                  "or the model config's batch_invariant_mode asks for invariant vocabulary ops")


def _sources(spec: _vocab.OpSpec, tensors: Sequence[torch.Tensor], selected: torch.Tensor | None) -> list[Source]:
    """One tile source per model (student first), every hidden row gathered, then the selected ones."""
    return [Source(spec.n_valid, spec.chunk_rows, weight=w,
                   hidden=take_rows(gather_rows(h, spec.group, spec.sequence_parallel), selected))
            for h, w in zip(tensors[0::2], tensors[1::2])]


def _walk(sources: list[Source], dtype: torch.dtype, keep_mask: torch.Tensor | None):
    """(rows, cols, [x per model], kept) for every tile, every model's tile the same columns;
    ids outside keep_mask set to −inf in every model's tile."""
    for parts in zip(*(tiles(s, dtype) for s in sources)):
        rows, cols = parts[0][0], parts[0][1]
        xs = [x for _, _, x in parts]
        kept = keep_mask[rows, cols] if keep_mask is not None else None
        if kept is not None:
            for x in xs:
                x.masked_fill_(~kept, float("-inf"))
        yield rows, cols, xs, kept


def _backend_stats(sources, dtype, scale, backend: Backend) -> list[_stats.RowStats]:
    """Every model's normalizer (max, Σ e^u) over this rank's shard, folded by the backend."""
    n_rows, device = sources[0].n_rows, sources[0].first.device
    no_marks = torch.zeros(n_rows, 0, dtype=torch.long, device=device)
    return [backend.row_stats(src, _stats.RowStats.empty(n_rows, 0, dtype, device), no_marks,
                              no_marks.bool(), None, scale) for src in sources]


def _normalizers(sources, dtype, scale, keep_mask, spec, checks, plan: ResolvedDivergence, backend: Backend):
    """Pass 1: every model's (shift, log S) combined over the ranks, and the cross terms of a
    one-pass divergence (else None); bad rows of any model raise here (the call's one host sync)."""
    n_rows, device = sources[0].n_rows, sources[0].first.device
    leads = tiles_math.cross_leads(plan, len(sources) - 1)  # whose probabilities weigh each cross term
    crosses = torch.zeros(len(leads), n_rows, dtype=dtype, device=device)
    if leads or keep_mask is not None or backend.divergence_pass1_on_tiles:
        stats = [_stats.RowStats.empty(n_rows, 0, dtype, device) for _ in sources]
        for rows, _, xs, kept in _walk(sources, dtype, keep_mask):
            s_rows = _stats.scale_rows(scale, rows)
            olds = [stats[lead].shift[rows].clone() for lead in leads]
            for st, x in zip(stats, xs):
                _stats.fold_tile(st, rows, x, s_rows, None, None)
            for cross, lead, old in zip(crosses, leads, olds):
                tiles_math.fold_cross(cross, rows, old, stats[lead], xs[lead], xs[1 - lead], s_rows, kept)
    else:
        stats = _backend_stats(sources, dtype, scale, backend)
    local_shifts = [stats[lead].shift for lead in leads]
    combined = [_stats.combine_over_ranks(st, scale, spec.group) for st in stats]
    if leads and _dist.tp_size(spec.group) > 1:
        # SUM all-reduce over the tensor-parallel group of the cross terms (one call for all), each
        # rank's moved to its lead model's global max (as the core moves its sums)
        factors = [_stats.moved(local, combined[lead].safe_shift, _stats.per_row(scale))[1]
                   for local, lead in zip(local_shifts, leads)]
        crosses = _dist.all_reduce_sum_(crosses * torch.stack(factors), spec.group)
    if keep_mask is not None:  # finite logits and a -inf max: no id kept in that row, on any rank
        empty = torch.isneginf(combined[0].shift)
        checks.require(~empty, lambda: ValueError(
            f"{spec.op}: keep_mask keeps no vocabulary id in rows {torch.nonzero(empty).squeeze(1)[:8].tolist()}; "
            "keep at least one id per row (or drop those rows from the loss)"))
    for j, st in enumerate(combined):
        what = spec.arg if j == 0 else f"teacher {j - 1}'s logits (teacher_hidden @ teacher_weight.T)"
        _checks.require_good_rows(checks, st.shift, spec.op, what)
    checks.raise_first()
    log_sums = []
    for st in combined:
        assert st.rest is not None  # folded with the rest's sum
        log_sums.append(st.rest.log())
    return [st.safe_shift for st in combined], log_sums, (list(crosses) if leads else None)


def _tile_log_probs(xs, rows, shifts, log_sums, scale, log_w):
    """(a, b): the student's and the teachers' mixture's log-probs of one tile (over the tiles)."""
    lps = [tiles_math.log_probs_(x, shifts[j][rows], log_sums[j][rows], scale) for j, x in enumerate(xs)]
    return lps[0], tiles_math.mixture_(lps[1:], log_w)


def _norms(shifts: list[torch.Tensor], log_sums: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Each model's [2, T] (shift, log S): what a backend's divergence step reads."""
    return tuple(torch.stack([shift, log_sum]) for shift, log_sum in zip(shifts, log_sums))


def _tile_grads(sources, plan: ResolvedDivergence, shifts, log_sums, consts, scale, row_factor, keep_mask, log_w,
                needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dL/dh, dL/dW) of the student on torch tiles: dz = (g − p·G)·row_factor per tile, the
    table's gradient terms, accumulated by two matmuls."""
    dtype = shifts[0].dtype
    hidden, weight = sources[0].hidden, sources[0].weight
    assert hidden is not None and weight is not None  # the sources are fused
    grad_h = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if needs[0] else None
    grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if needs[1] else None
    for rows, cols, xs, kept in _walk(sources, dtype, keep_mask):
        a, b = _tile_log_probs(xs, rows, shifts, log_sums, _stats.scale_rows(scale, rows), log_w)
        dz = tiles_math.student_grad(plan, a, b, consts[0][rows] if consts else None, kept)
        dz.mul_(row_factor[rows, None])
        accumulate(grad_h, grad_w, dz, hidden[rows], weight[cols], rows, cols)
    return grad_h, grad_w


class LmHeadDivergence(torch.autograd.Function):
    """The per-token divergence; saved: the models' tensors (alive anyway), ≤ 2(1+n)+2 per token."""

    @staticmethod
    def forward(ctx, choice, spec: _vocab.OpSpec, checks, keep_mask, tau, log_w, *tensors):
        plan, backend, selected = choice
        sources = _sources(spec, tensors, selected)
        dtype = _stats.compute_dtype(tensors[0].dtype)
        scale = _stats.row_scale(tau, sources[0].n_rows, dtype)
        shifts, log_sums, crosses = _normalizers(sources, dtype, scale, keep_mask, spec, checks, plan, backend)
        if crosses is not None:
            sums = tiles_math.one_pass_sums(plan, crosses, shifts, log_sums, scale)
            value = sums[:, 0].clone()
        else:
            kernels = divergence_step(backend, sources[0], sources[1:], plan)
            if kernels is not None:
                sums = kernels.divergence_sums(sources[0], sources[1], _norms(shifts, log_sums), plan, scale,
                                               keep_mask)[:, :tiles_math.n_sums(plan)].contiguous()
            else:
                # no tile on a rank holding only vocabulary padding: its share stays 0
                sums = torch.zeros(sources[0].n_rows, tiles_math.n_sums(plan), dtype=dtype, device=tensors[0].device)
                for rows, _, xs, kept in _walk(sources, dtype, keep_mask):
                    a, b = _tile_log_probs(xs, rows, shifts, log_sums, _stats.scale_rows(scale, rows), log_w)
                    sums[rows] += tiles_math.row_sums(plan, a, b, kept)
            # SUM all-reduce over the tensor-parallel group: each rank's vocab shard adds its
            # columns' share of the value and of every row constant
            sums = _dist.all_reduce_sum_(sums, spec.group)
            value = sums[:, 0].clone()
        ctx.plan, ctx.selected, ctx.spec, ctx.n_tensors = plan, selected, spec, len(tensors)
        ctx.backend = backend
        ctx.set_materialize_grads(False)
        constant = tiles_math.grad_constant(plan, sums)
        consts = [] if constant is None else [constant]
        ctx.save_for_backward(*tensors, torch.stack(shifts + log_sums + consts), keep_mask, save_tau(ctx, tau), log_w)
        return value

    @staticmethod
    @_vocab.reject_double_backward
    def backward(ctx, grad_value):
        *tensors, saved, keep_mask, tau, log_w = ctx.saved_tensors
        none = (None,) * 6
        if grad_value is None or not any(ctx.needs_input_grad[6:8]):
            return none + (None,) * ctx.n_tensors
        plan: ResolvedDivergence = ctx.plan
        spec: _vocab.OpSpec = ctx.spec
        sources = _sources(spec, tensors, ctx.selected)
        n_models, dtype = len(sources), saved.dtype
        scale = saved_scale(ctx, tau, sources[0].n_rows, dtype)
        rows_saved = list(saved.unbind(0))
        shifts, log_sums, consts = rows_saved[:n_models], rows_saved[n_models:2 * n_models], rows_saved[2 * n_models:]
        # dL/dx = g·s·dD/dz per row (z = x·s)
        row_factor = grad_value.to(dtype) * _stats.per_row(scale)
        kernels = divergence_step(ctx.backend, sources[0], sources[1:], plan)
        if kernels is not None:
            grad_h, grad_w = kernels.divergence_grad(sources[0], sources[1], _norms(shifts, log_sums), plan, scale,
                                                     keep_mask, consts[0] if consts else None,
                                                     row_factor.contiguous(), ctx.needs_input_grad[6:8])
        else:
            grad_h, grad_w = _tile_grads(sources, plan, shifts, log_sums, consts, scale, row_factor, keep_mask, log_w,
                                         ctx.needs_input_grad[6:8])
        if grad_h is not None:
            n_gathered = tensors[0].size(0) * (_dist.tp_size(spec.group) if spec.sequence_parallel else 1)
            grad_h = scatter_rows(grad_h, ctx.selected, n_gathered)
            grad_h = reduce_rows(grad_h, spec.group, spec.sequence_parallel).to(tensors[0].dtype)
        if grad_w is not None:
            grad_w = grad_w.to(tensors[1].dtype)
        return none + (grad_h, grad_w) + (None,) * (ctx.n_tensors - 2)
