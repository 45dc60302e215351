"""Top-k on-policy distillation: vocab-parallel top-k ids, full-vocab log-probs at those ids plus
an exact tail bucket, and the (k+1)-bucket KL to a mixture of teachers (docs/topk-opd.md).

Everything is per token, so packed `thd`, CP-zigzag and allgather-CP tensors all work as long as
every input uses the same token layout; nothing here shifts tokens. Memory stays O(T·k) beyond
the logits: rows are processed in chunks and backward recomputes the softmax chunk by chunk. The
statistics core (one MAX and one SUM all-reduce per call) is shared with the log-prob op: :mod:`._stats`,
run by a backend of :mod:`.kernels` inside the autograd Functions of :mod:`._functions`.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_rl_patches.ops import _checks, _dist, _divergences, _vocab, topk_checks, topk_select
from megatron_rl_patches.ops._checks import Temperature, Weights
from megatron_rl_patches.ops._functions import TopkLogprobs
from megatron_rl_patches.ops._rows import RowSelection, unselected_as
from megatron_rl_patches.ops.invariance import agreed_invariant, agreed_route, resolve_invariant
from megatron_rl_patches.ops.kernels import resolve_backend, topk_step
from megatron_rl_patches.ops.kernels.sources import Source
from megatron_rl_patches.ops.row_blocks import in_row_blocks
from megatron_rl_patches.ops.scoring_plan import checked_k

__all__ = ["topk_ids", "union_ids", "topk_logprobs", "topk_kl", "topk_opd_loss"]

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- top-k ids


def topk_ids(
    logits: torch.Tensor,
    k: int,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    row_mask: torch.Tensor | None = None,
    backend: str = "auto",
    invariant: bool | None = None,
) -> torch.Tensor:
    """Global vocab ids of the k largest logits per row, descending (ties: lower id first).

    Vocab-parallel: each rank takes its local top-k and the ranks all-gather k candidates each
    (O(T·k·tp) communication); every rank returns the same ids. Padded columns (ids >=
    `vocab_size`) are never selected. No gradient. `row_mask` (bool, the logits' leading shape;
    the same on every rank): only those rows are ranked, the others get ids 0. `backend` as the
    other vocabulary ops (the selection of :mod:`.topk_select`; Triton: one kernel, exact ties).
    `invariant` is accepted for symmetry: the selection compares logits exactly, so each row's
    ids depend on its logits alone in both modes.
    """
    lead, local_vocab = topk_checks.check_logits(logits, "logits", tp_group)
    vocab = _checks.global_vocab(local_vocab, tp_group, vocab_size)
    k = checked_k(k, vocab=vocab)  # a plan's TopK taken as it is
    # checked (alike on every rank, with the values that shape the candidates' all-gather); exact either way
    agreed_invariant(invariant, "topk_ids", tp_group, match=_checks.collective_values(math.prod(lead), vocab, k=k))
    selection = _select(row_mask, lead, logits.device, tp_group)
    rows = selection.rows
    with torch.no_grad():
        every = logits.detach().reshape(-1, local_vocab)
        x = selection.take(every)[:, : _vocab.valid_local_columns(local_vocab, vocab, tp_group)]
        first_id = _dist.vocab_start(local_vocab, tp_group)
        run = topk_select.RunningTopk.empty(x.size(0), k, x.dtype, x.device, sentinel=vocab)
        source = Source(x.size(1), max(1, x.size(0)), logits=x)
        run = topk_step(resolve_backend(backend, logits.device, logits.dtype))(source, run, first_id)
        run = topk_select.over_ranks(run, tp_group)
        checks = _checks.DeviceChecks()
        _checks.require_good_rows(checks, run.row_max, "topk_ids", "logits", rows=rows, n_rows=every.size(0))
        ambiguous = checks.raise_first(read=topk_select.ambiguous_rows(run))  # the call's one host sync
        tied = [row for row, flag in enumerate(ambiguous) if flag]
        if tied:
            chunk = _vocab.default_chunk_rows(x.size(1), x.device, torch.int64)

            def row_tiles(listed: list[int], index: torch.Tensor) -> topk_select.Tiles:
                for start, stop in _vocab.row_chunks(index.numel(), chunk):
                    yield slice(start, stop), slice(0, x.size(1)), x[index[start:stop]]

            topk_select.exact_rows(run, tied, row_tiles, first_id, tp_group)
        ids = selection.scatter(run.ids)
    return ids.reshape(*lead, k)


def _select(row_mask: object, lead: torch.Size, device: torch.device, group: dist.ProcessGroup | None,
            holder: str = "logits") -> RowSelection:
    """The selection of a `row_mask` shaped as the logits' leading dims (flattened)."""
    n_rows = math.prod(lead)
    if isinstance(row_mask, torch.Tensor) and row_mask.shape == lead:
        row_mask = row_mask.reshape(n_rows)
    return RowSelection.of(row_mask, n_rows, device, holder, group)


# ----------------------------------------------------------------------------- union of id sets
PAD_ID = -1  # the id of union_ids' padded slots: no op reads it without the mask (an error there)


def union_ids(student_ids: torch.Tensor, teacher_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of two id sets per row, as (ids [..., k_s + k_t] int64, ids_mask [..., k_s + k_t]
    bool): the student's ids first, in their order, then the teacher's ids the student lacks, in
    theirs, then padding (id -1, mask False) up to the fixed width. Pass both to the ops
    (`topk_logprobs(..., ids_mask=)`, `lm_head_topk_logprobs`, `topk_kl`, `topk_opd_loss`): the
    padded slots are empty buckets and the tail stays exact. Ids within each set must not repeat
    (as `topk_ids` returns them); no gradient, no host sync."""
    _checks.check_id_tensor(student_ids, "student_ids", "[T, k]")
    _checks.check_id_tensor(teacher_ids, "teacher_ids", "[T, k]")
    if (student_ids.dim() < 1 or student_ids.shape[:-1] != teacher_ids.shape[:-1]
            or student_ids.dim() != teacher_ids.dim() or student_ids.device != teacher_ids.device):
        raise ValueError(
            f"student_ids and teacher_ids must share their leading dims and device ([..., k_s] and [..., k_t]), "
            f"got {tuple(student_ids.shape)} on {student_ids.device} "
            f"and {tuple(teacher_ids.shape)} on {teacher_ids.device}"
        )
    student, teacher = student_ids.long(), teacher_ids.long()
    # [..., k_t, k_s] comparison: O(T·k_t·k_s) bools, fine for top-k sizes
    new = ~(teacher[..., :, None] == student[..., None, :]).any(dim=-1)
    first = torch.sort((~new).to(torch.int8), dim=-1, stable=True).indices  # the new ids first, in order
    new = new.gather(-1, first)
    teacher = torch.where(new, teacher.gather(-1, first), PAD_ID)
    return torch.cat([student, teacher], dim=-1), torch.cat([torch.ones_like(student, dtype=torch.bool), new], dim=-1)


# ----------------------------------------------------------------------------- top-k log-probs
def _topk_logprobs_checked(
    logits: torch.Tensor,
    ids: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    temperature: object,
    vocab_size: object,
    chunk_size: object,
    checks: _checks.DeviceChecks,
    op: str = "topk_logprobs",
    name: str = "logits",
    backend: str = "auto",
    ids_mask: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    invariant: object = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Size, int, RowSelection, bool]:
    """(log-probs [R, k], tail [R], leading dims, k, the row selection, the resolved invariant
    mode): R = every row."""
    lead, local_vocab = topk_checks.check_logits(logits, name, tp_group)
    vocab = _checks.global_vocab(local_vocab, tp_group, vocab_size)
    selection = _select(row_mask, lead, logits.device, tp_group, name)
    k = topk_checks.check_ids(_unselected_ids(ids, selection.mask, lead), lead, vocab, checks, ids_mask)
    tau = _checks.check_temperature(temperature, lead, logits.device, checks, logits.dtype)
    chunk_rows = _vocab.logits_chunk_rows(_checks.check_chunk_size(chunk_size), local_vocab, tp_group, vocab, logits)
    invariant, chosen = agreed_route(invariant, op, tp_group,
                                     lambda mode: resolve_backend(backend, logits.device, logits.dtype, mode), vocab,
                                     match=_checks.collective_values(math.prod(lead), vocab, tau, k=k,
                                                                     ids_mask=ids_mask is not None))
    spec = _vocab.op_spec(local_vocab, tp_group, vocab, chunk_rows, op, arg=name, invariant=invariant)
    flat_ids = ids.reshape(-1, k).to(device=logits.device, dtype=torch.long)
    valid = None if ids_mask is None else ids_mask.reshape(-1, k).to(logits.device)
    tau = selection.take_values(tau.reshape(-1) if isinstance(tau, torch.Tensor) else tau)
    logp, tail = TopkLogprobs.apply(selection.take(flat_ids), selection.take(valid), tau, spec,
                                    checks, chosen, selection.rows, logits.reshape(-1, local_vocab))
    return logp, tail, lead, k, selection, spec.invariant


def _unselected_ids(ids: object, flat_mask: torch.Tensor | None, lead: torch.Size) -> object:
    """ids with the unselected rows' slots replaced by valid distinct ids (see _rows.unselected_as)."""
    if (flat_mask is None or not isinstance(ids, torch.Tensor) or ids.shape[:-1] != lead
            or ids.device != flat_mask.device):
        return ids
    return unselected_as(ids.reshape(flat_mask.numel(), -1), flat_mask).reshape(ids.shape)


def topk_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    ids_mask: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    temperature: Temperature = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    row_mask: torch.Tensor | None = None,
    invariant: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (normalized over the full vocab, logits / temperature) at `ids` [T, k] and the
    log of the remaining mass [T], from the complement's log-sum-exp; differentiable.

    `tp_group`/`vocab_size` as in `log_probs_and_entropy`: logits [T, V_local] sharded over
    `tp_group` (None: no tensor parallelism), ids global, padded columns excluded. Output is
    float32 (float64 for float64 logits). `chunk_size` is rows per chunk (None: automatic).
    `ids_mask` (bool, ids' shape; e.g. from `union_ids`): False slots are padding, whatever
    their id: log-prob -inf with no gradient, and their mass stays in the tail. `row_mask` (bool,
    the logits' leading shape; the same on every rank): only those rows are computed, the
    others' outputs are 0 with no gradient and their ids are not read. `invariant`: each row's
    outputs a function of that row's logits alone, bit for bit (None: the setting
    ``MEGATRON_RL_PATCHES_INVARIANT``; docs/train-rollout-agreement.md).
    """
    logp, tail, lead, k, _, _ = _topk_logprobs_checked(
        logits, ids, tp_group, temperature, vocab_size, chunk_size, _checks.DeviceChecks(), backend=backend,
        ids_mask=ids_mask, row_mask=row_mask, invariant=invariant,  # agreed over tp_group in there
    )
    return logp.reshape(*lead, k), tail.reshape(lead)


# ----------------------------------------------------------------------------- OPD loss
def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler's two branches)."""
    near_zero = x > -math.log(2.0)
    return torch.where(near_zero, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _derived_tail(logprobs: torch.Tensor, source_dtype: torch.dtype) -> torch.Tensor:
    """Teacher tail log-mass from its top-k log-probs alone: log(1 - sum_k q), floored.

    From k rounded log-probs the tail is only known to about the dtype's epsilon, and rounding
    can make sum_k q reach or exceed 1; the mass is floored at the epsilon of the dtype the
    teacher log-probs came in (`source_dtype`), so the tail stays finite.
    """
    floor = math.log(max(torch.finfo(source_dtype).eps, torch.finfo(logprobs.dtype).eps))
    covered = torch.logsumexp(logprobs, dim=-1).clamp(max=0.0)
    return log1mexp(covered).clamp(min=floor)


def _bucket_divergence(
    log_p: torch.Tensor,
    teachers: torch.Tensor,
    teacher_tails: torch.Tensor | None,
    log_w: torch.Tensor,
    plan: _divergences.ResolvedDivergence,
    valid: torch.Tensor | None = None,
    renormalize: bool = False,
) -> torch.Tensor:
    """Per-row divergence between the student's buckets `log_p` [R, k+1] and the teacher mixture
    (teachers [n, ..., k] in their source dtype, tails [n, ...] or None: derived). Id buckets not
    `valid` [R, k] are empty (-inf) on every side. `renormalize`: the tails dropped and every
    model renormalized over its k ids before the teachers are mixed."""
    n, k, source_dtype = teachers.shape[0], teachers.shape[-1], teachers.dtype
    dtype = log_p.dtype
    teachers = teachers.detach().to(device=log_p.device, dtype=dtype).reshape(n, -1, k)
    if valid is not None:
        teachers = teachers.masked_fill(~valid, _NEG_INF)
        log_p = torch.cat([log_p[:, :k].masked_fill(~valid, _NEG_INF), log_p[:, k:]], dim=1)
    if renormalize:
        log_p, log_qs = _divergences.renormalized(log_p[:, :k]), _divergences.renormalized(teachers)
    elif teacher_tails is None:
        log_qs = torch.cat([teachers, _derived_tail(teachers, source_dtype)[..., None]], dim=-1)
    else:
        tails = teacher_tails.detach().to(device=log_p.device, dtype=dtype).reshape(n, -1)
        log_qs = torch.cat([teachers, tails[..., None]], dim=-1)
    log_q = log_qs[0] if n == 1 else torch.logsumexp(log_qs + log_w[:, None, None], dim=0)
    return _divergences.bucket_divergence(plan, log_p, log_q)


def _divergence_rows(log_p: torch.Tensor, teachers: torch.Tensor, teacher_tails: torch.Tensor | None,
                     log_w: torch.Tensor, plan: _divergences.ResolvedDivergence, valid: torch.Tensor | None,
                     renormalize: bool, invariant: bool) -> torch.Tensor:
    """:func:`_bucket_divergence`, in fixed row blocks when `invariant` (teachers moved rows-first
    for the blocks, back inside)."""
    if not invariant:
        return _bucket_divergence(log_p, teachers, teacher_tails, log_w, plan, valid, renormalize)
    n, k = teachers.shape[0], teachers.shape[-1]
    rows_first = teachers.reshape(n, -1, k).transpose(0, 1)
    tails = None if teacher_tails is None else teacher_tails.reshape(n, -1).transpose(0, 1)

    def block(lp, tq, tt, ok):
        return _bucket_divergence(lp, tq.transpose(0, 1), None if tt is None else tt.transpose(0, 1), log_w, plan, ok,
                                  renormalize)

    return in_row_blocks(block, log_p.size(0), log_p, rows_first, tails, valid)


def topk_kl(
    student_logprobs: torch.Tensor,
    student_tail: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    teacher_tail: torch.Tensor | None = None,
    *,
    teacher_weights: Weights = None,
    divergence: str | None = None,
    beta: float = _divergences.DEFAULT_BETA,
    alpha: float = _divergences.DEFAULT_ALPHA,
    renormalize: bool = False,
    ids_mask: torch.Tensor | None = None,
    kl: str | None = None,
    mix: float | None = None,
    invariant: bool | None = None,
) -> torch.Tensor:
    """Per-token divergence [T] between (k+1)-bucket distributions that are already computed: the
    student's log-probs at the k ids [T, k] and its tail [T] (from `topk_logprobs` or
    `lm_head_topk_logprobs`), against the teachers' [T, k] or [n, T, k] (tails [T] / [n, T], or
    None: derived stably from their k log-probs). Options as `topk_opd_loss`; the gradient flows
    to the student's buckets only. `ids_mask` (bool [T, k]): buckets where it is False are
    padding, empty for the student and every teacher whatever values they hold. `invariant`: each
    row's value from that row's buckets alone, bit for bit (computed in fixed row blocks)."""
    mode = resolve_invariant(invariant)
    plan = _divergences.ResolvedDivergence.of(*topk_checks.resolve_divergence(divergence, beta, alpha, kl, mix))
    renormalize = _divergences.check_renormalize(renormalize)
    _checks.check_float_tensor(student_logprobs, "student_logprobs", "[T, k]")
    _checks.check_float_tensor(student_tail, "student_tail", "[T]")
    if student_logprobs.dim() < 1 or student_logprobs.shape[-1] == 0:
        raise ValueError(f"student_logprobs must have shape [T, k] with k >= 1, got {tuple(student_logprobs.shape)}")
    lead = student_logprobs.shape[:-1]
    if student_tail.shape != lead:
        raise ValueError(
            f"student_tail must have shape {tuple(lead)} to match student_logprobs {tuple(student_logprobs.shape)}, "
            f"got {tuple(student_tail.shape)}"
        )
    if student_tail.dtype != student_logprobs.dtype or student_tail.device != student_logprobs.device:
        raise ValueError("student_tail must have student_logprobs' dtype and device (both come from one top-k op)")
    topk_checks.check_ids_mask(ids_mask, student_logprobs, "student_logprobs")
    checks = _checks.DeviceChecks()
    topk_checks.check_logprob_values(student_logprobs.detach(), "student_logprobs", checks)
    topk_checks.check_logprob_values(student_tail.detach(), "student_tail", checks)
    dtype = _vocab.compute_dtype(student_logprobs.dtype)
    teachers, teacher_tails, log_w = topk_checks.check_mixture(teacher_logprobs, teacher_tail, student_logprobs.shape,
                                                    teacher_weights, dtype, student_logprobs.device, checks)
    checks.raise_first()  # one host sync for every value check
    k = student_logprobs.shape[-1]
    log_p = torch.cat([student_logprobs.reshape(-1, k).to(dtype), student_tail.reshape(-1, 1).to(dtype)], dim=1)
    valid = None if ids_mask is None else ids_mask.reshape(-1, k)
    return _divergence_rows(log_p, teachers, teacher_tails, log_w, plan, valid, renormalize, mode).reshape(lead)


def topk_opd_loss(
    student_logits: torch.Tensor,
    ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    teacher_tail_logprobs: torch.Tensor | None = None,
    *,
    teacher_weights: Weights = None,
    divergence: str | None = None,
    beta: float = _divergences.DEFAULT_BETA,
    alpha: float = _divergences.DEFAULT_ALPHA,
    renormalize: bool = False,
    ids_mask: torch.Tensor | None = None,
    kl: str | None = None,
    mix: float | None = None,
    tp_group: dist.ProcessGroup | None = None,
    temperature: Temperature = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    row_mask: torch.Tensor | None = None,
    invariant: bool | None = None,
) -> torch.Tensor:
    """Per-token divergence [T] between the student's and the teacher mixture's (k+1)-bucket
    distributions (the k ids plus one tail bucket); gradient flows to the student logits only.
    The same as ``topk_kl(*topk_logprobs(student_logits, ids, ...), teacher_logprobs, ...)``,
    with one host sync for all checks.

    Shapes: student_logits [T, V_local] (this rank's vocab shard under `tp_group`; any leading
    shape [*rows, V_local] works, T = rows); ids [T, k] global vocabulary ids; teacher_logprobs
    [T, k] for one teacher or [n, T, k] (each teacher's full-vocabulary log-probs at `ids`);
    teacher_tail_logprobs None, [T] or [n, T]; teacher_weights [n]; ids_mask [T, k] bool;
    row_mask [T] bool. Returns [T].

    divergence (None: "reverse_kl"): one of "forward_kl" KL(q‖p), "reverse_kl" KL(p‖q), "jsd"
    (weight `beta` on the teacher; 0: forward, 1: reverse KL), "skew_forward_kl",
    "skew_reverse_kl" (own share `alpha`), "tv", "mixed_kl" (β·reverse + (1 − β)·forward, β =
    `beta`) (docs/distillation.md). The deprecated
    kl="reverse" / "forward" / "mixed" (mix·forward + (1 − mix)·reverse) still work with a
    DeprecationWarning; giving both is a TypeError. The mixture is q = sum_j w_j q_j with
    `teacher_weights` w the mixture's probabilities (>= 0, summing to 1 within 1e-6; None:
    uniform; a str is refused, an iterator read once), as for `lm_head_divergence`; a sum != 1 is
    still divided out, with a FutureWarning, and refused from the next release. Teacher tails
    default to log(1 - sum_k q_j), computed stably and floored at the dtype's epsilon.
    Zero-probability buckets: 0·log 0 = 0; a bucket with zero probability on the reference side
    only makes that token's KL +inf (that bucket gives no gradient). `ids_mask` (bool, ids'
    shape; e.g. from `union_ids`): padded slots, as in `topk_logprobs`, empty buckets for every
    model. `row_mask` (bool, the student logits' leading shape): only those rows are computed;
    the others' divergence is 0 with no gradient. `invariant`: as in `topk_logprobs` and `topk_kl`.
    """
    plan = _divergences.ResolvedDivergence.of(*topk_checks.resolve_divergence(divergence, beta, alpha, kl, mix))
    renormalize = _divergences.check_renormalize(renormalize)
    lead, _ = topk_checks.check_logits(student_logits, "student_logits", tp_group)
    _checks.check_id_tensor(ids, "ids", "[T, k]")
    if ids.dim() < 1 or tuple(ids.shape[:-1]) != tuple(lead):  # before the teachers are compared with ids
        raise ValueError(f"ids must have shape [*rows, k] with rows {tuple(lead)} of student_logits "
                         f"{tuple(student_logits.shape)}, got {tuple(ids.shape)}")
    checks = _checks.DeviceChecks()
    dtype = _vocab.compute_dtype(student_logits.dtype)
    teachers, teacher_tails, log_w = topk_checks.check_mixture(teacher_logprobs, teacher_tail_logprobs, ids.shape,
                                                    teacher_weights, dtype, student_logits.device, checks)
    logp, tail, lead, k, selection, mode = _topk_logprobs_checked(
        student_logits, ids, tp_group, temperature, vocab_size, chunk_size, checks, "topk_opd_loss", "student_logits",
        backend, ids_mask, row_mask, invariant,
    )
    rows = selection.rows
    log_p = selection.take(torch.cat([logp, tail[:, None]], dim=1))
    valid = None if ids_mask is None else selection.take(ids_mask.reshape(-1, k).to(log_p.device))
    if rows is not None:
        n = teachers.shape[0]
        teachers = teachers.reshape(n, -1, k).index_select(1, rows.to(teachers.device))
        if teacher_tails is not None:
            teacher_tails = teacher_tails.reshape(n, -1).index_select(1, rows.to(teacher_tails.device))
    value = _divergence_rows(log_p, teachers, teacher_tails, log_w, plan, valid, renormalize, mode)
    return selection.scatter(value).reshape(lead)
