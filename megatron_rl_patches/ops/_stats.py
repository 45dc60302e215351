"""The one statistics core of every vocabulary op: per-row softmax statistics and their steps.

Every op (log-prob + entropy, top-k log-probs + tail; on materialized logits or from hidden
states) runs the same four named steps:

1. **fold** (:func:`fold_tile`): one tile x [rows, cols] of logits (raw units) into this rank's
   running :class:`RowStats`, online-softmax style (the running max moves, earlier sums rescale);
2. **combine** (:func:`combine_over_ranks`): every rank's statistics moved to the global maxima
   with one MAX and one SUM all-reduce of O(T) values (nothing without tensor parallelism);
3. **finalize** (:func:`log_prob_outputs`, :func:`topk_outputs`): log-probs, entropy, tail;
4. **gradient** (:func:`tile_grad`): dL/dx of one recomputed tile from saved per-row
   :class:`GradFactors` — the same formula for every op.

A backend (the contract, public in :mod:`megatron_rl_patches.ops.kernels`) runs fold over a
source's tiles (``row_stats``) and the gradient formula over them (``apply_grad``), from the
:class:`RowStats` and :class:`GradFactors` defined here.

The steps a backend shares with the ops: moving sums to a new max (:func:`moved`,
:func:`moved_stats`, here), accumulating dh/dW (``kernels.torch_tiles.accumulate``), the saved
temperature (``_functions.save_tau`` / ``saved_scale``), the bad-row check
(``_checks.require_good_rows``).

Combine, finalize, the autograd Functions and every public op are shared; a backend computes
nothing else. Units: ``u = (x - shift)·s`` with s = 1/τ per row; subtracting before scaling
keeps entries near the row max exact (Sterbenz), where the probability mass is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist

from megatron_rl_patches.ops._dist import all_reduce_max_, all_reduce_sum_, tp_size
from megatron_rl_patches.ops._dtype import compute_dtype as compute_dtype  # the ops read it here

# Finite stand-in for -inf shifted logits where e^u·u would otherwise be 0·(-inf) = NaN; exp of
# anything below it is exactly 0 in float32 and float64.
NEG_FLOOR = -1.0e4


# ----------------------------------------------------------------------------- small numerics


def row_scale(temperature: float | torch.Tensor, n_rows: int, dtype: torch.dtype) -> float | torch.Tensor:
    """1/temperature as a float, or as a [n_rows, 1] tensor of `dtype` for a tensor temperature."""
    if isinstance(temperature, torch.Tensor):
        return (1.0 / temperature.to(dtype)).expand(n_rows).reshape(n_rows, 1)
    return 1.0 / float(temperature)


def scale_rows(scale: float | torch.Tensor, rows: slice | torch.Tensor) -> float | torch.Tensor:
    """The scale of some rows (a float applies to every row)."""
    return scale[rows] if isinstance(scale, torch.Tensor) else scale


def per_row(scale: float | torch.Tensor) -> float | torch.Tensor:
    """A [rows, 1] scale as [rows] (a float as is), to multiply per-row values."""
    return scale.squeeze(1) if isinstance(scale, torch.Tensor) else scale


def local_row_max(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-row max as `dtype`; NaN mapped to +inf so a MAX all-reduce keeps it; -inf with no column."""
    if x.size(1) == 0:
        return torch.full((x.size(0),), -math.inf, dtype=dtype, device=x.device)
    m = x.amax(dim=1).to(dtype)
    return torch.where(torch.isnan(m), math.inf, m)


def finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """Non-finite shifts (empty or invalid rows) replaced by 0 so shifted values stay finite."""
    return torch.where(torch.isfinite(m), m, 0.0)


def shifted_rows(x: torch.Tensor, shift: torch.Tensor, scale: float | torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = (x - shift)·scale`` with a per-row `shift` in raw units (subtract first: exact near the max)."""
    torch.sub(x, shift.unsqueeze(1), out=out)
    if isinstance(scale, torch.Tensor) or scale != 1.0:
        out.mul_(scale)
    return out


def column_marks(cols: torch.Tensor, owned: torch.Tensor, first: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For marked ids as local columns [r, k] (`owned` by this rank): their column in the tile
    [first, first + width) (clamped into it) and whether they fall in it. No host sync."""
    local = cols - first
    inside = owned & (local >= 0) & (local < width)
    return local.clamp(0, max(width - 1, 0)), inside


def marks_mask(shape: torch.Size, local: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """[r, c] bool: the tile's marked columns. Ids outside the tile were clamped onto tile columns,
    so marks are counted (a plain scatter could let them overwrite a real mark)."""
    counts = torch.zeros(shape, dtype=torch.int32, device=local.device)
    return counts.scatter_add_(1, local, inside.to(torch.int32)) > 0


# ----------------------------------------------------------------------------- statistics


@dataclass
class RowStats:
    """Per-row softmax statistics over the vocabulary columns folded so far (raw logit units).

    ``shift``: running max of x over every column (NaN -> +inf, -inf before any column);
    ``marked`` [T, k]: x at the marked columns (the target, the top-k ids), 0 where not folded
    here; ``rest``/``moment``: Σ e^u and Σ e^u·u over the unmarked columns, u = (x - safe
    shift)·s; ``sub_shift``/``sub_sum``: a column subset's own running max and Σ e^((x -
    sub_shift)·s) over its unmarked columns (kept ids; the top-k tail). Unwanted sums are None.
    """

    shift: torch.Tensor
    marked: torch.Tensor
    rest: torch.Tensor | None = None
    moment: torch.Tensor | None = None
    sub_shift: torch.Tensor | None = None
    sub_sum: torch.Tensor | None = None

    @classmethod
    def empty(cls, n_rows: int, k: int, dtype: torch.dtype, device: torch.device, *, rest: bool = True,
              moment: bool = False, subset: bool = False) -> RowStats:
        """Statistics of no column yet, with the sums asked for."""

        def need(value: float, shape: tuple[int, ...] = (n_rows,)) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        def full(value: float, wanted: bool = True, shape: tuple[int, ...] = (n_rows,)) -> torch.Tensor | None:
            return need(value, shape) if wanted else None

        return cls(shift=need(-math.inf), marked=need(0.0, (n_rows, k)), rest=full(0.0, rest or moment),
                   moment=full(0.0, moment), sub_shift=full(-math.inf, subset), sub_sum=full(0.0, subset))

    @property
    def safe_shift(self) -> torch.Tensor:
        return finite_or_zero(self.shift)


def fold_tile(stats: RowStats, rows: slice, x: torch.Tensor, scale: float | torch.Tensor,
              marks: tuple[torch.Tensor, torch.Tensor] | None, subset: torch.Tensor | None) -> None:
    """Fold the tile x [r, c] (rows `rows`, any float dtype) into `stats`, in place.

    `marks`: (local column [r, k], inside [r, k]) of the marked ids in this tile (see
    :func:`column_marks`); their logits are gathered, and they stay out of every sum. `subset`
    [r, c] bool: the kept columns, whose max counts the marked ones too (None: the subset is the
    tail, every unmarked column). -inf
    columns add nothing; NaN/+inf show up as a +inf shift, which the ops report.
    """
    dtype = stats.shift.dtype
    s_row = per_row(scale)
    marked = None
    if marks is not None:
        local, inside = marks
        stats.marked[rows] += torch.where(inside, x.gather(1, local).to(dtype), 0.0)
        marked = marks_mask(x.shape, local, inside)
    if stats.rest is not None:
        new_shift = torch.maximum(stats.shift[rows], local_row_max(x, dtype))
        log_factor, factor = moved(stats.shift[rows], finite_or_zero(new_shift), s_row)
        shifted = shifted_rows(x, finite_or_zero(new_shift), scale,
                               out=torch.empty(x.shape, dtype=dtype, device=x.device))
        exps = torch.exp(shifted)
        if marked is not None:
            exps.masked_fill_(marked, 0.0)
        if stats.moment is not None:
            moment = torch.linalg.vecdot(exps, shifted.clamp_min_(NEG_FLOOR))
            stats.moment[rows] = factor * (stats.moment[rows] + stats.rest[rows] * log_factor) + moment
        stats.rest[rows] = stats.rest[rows] * factor + exps.sum(dim=1)
        stats.shift[rows] = new_shift
    else:
        stats.shift[rows] = torch.maximum(stats.shift[rows], local_row_max(x, dtype))
    if stats.sub_shift is not None:
        _fold_subset(stats, rows, x, scale, s_row, marked, subset)


def _fold_subset(stats: RowStats, rows: slice, x: torch.Tensor, scale, s_row, marked: torch.Tensor | None,
                 subset: torch.Tensor | None) -> None:
    """The subset's exp-sum over its unmarked columns, with its own running max."""
    dtype = stats.shift.dtype
    assert stats.sub_shift is not None and stats.sub_sum is not None  # folded only with a subset
    if subset is not None:  # kept ids: the marked target is always kept and counts for the max
        sub_x = x.masked_fill(~(subset if marked is None else subset | marked), -math.inf)
    elif marked is not None:  # the tail: every unmarked column
        sub_x = x.masked_fill(marked, -math.inf)
    else:
        sub_x = x
    new_shift = torch.maximum(stats.sub_shift[rows], local_row_max(sub_x, dtype))
    _, factor = moved(stats.sub_shift[rows], finite_or_zero(new_shift), s_row)
    exps = shifted_rows(sub_x, finite_or_zero(new_shift), scale,
                        out=torch.empty(x.shape, dtype=dtype, device=x.device)).exp_()
    if marked is not None:
        exps.masked_fill_(marked, 0.0)
    stats.sub_sum[rows] = stats.sub_sum[rows] * factor + exps.sum(dim=1)
    stats.sub_shift[rows] = new_shift


def moved(old: torch.Tensor, new_safe: torch.Tensor, s_row: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log factor, factor) moving sums taken at shift `old` to `new_safe`: (old - new)·s and its
    exp; (0, 0) where nothing was summed yet (old = -inf). The log factor is floored at NEG_FLOOR
    (its exp is 0 either way): at the smallest temperature (old - new)·s overflows to -inf, and the
    moment's rest·log_factor·factor would be 0·(-inf) = NaN."""
    started = torch.isfinite(old)
    log_factor = torch.where(started, ((old - new_safe) * s_row).clamp_min(NEG_FLOOR), 0.0)
    return log_factor, torch.where(started, log_factor.exp(), 0.0)


def moved_stats(stats: RowStats, shift: torch.Tensor, sub_shift: torch.Tensor | None,
                s_row: float | torch.Tensor) -> RowStats:
    """`stats` with every exp-sum moved to the (finite or zero) shifts `shift` / `sub_shift`, which
    broadcast against them (a [T] max over splits [S, T], or the global max over ranks): summing
    moved statistics over splits or ranks merges them."""
    out = replace(stats, shift=shift)
    if stats.rest is not None:
        log_factor, factor = moved(stats.shift, shift, s_row)
        out.rest = stats.rest * factor
        if stats.moment is not None:
            out.moment = factor * (stats.moment + stats.rest * log_factor)  # Σ e^(u+d)·(u+d)
    if stats.sub_sum is not None:
        assert stats.sub_shift is not None and sub_shift is not None  # kept with sub_sum
        out.sub_shift = sub_shift
        out.sub_sum = stats.sub_sum * moved(stats.sub_shift, sub_shift, s_row)[1]
    return out


def combine_over_ranks(stats: RowStats, scale: float | torch.Tensor, group: dist.ProcessGroup | None) -> RowStats:
    """Every rank's statistics moved to the global maxima and summed: the full-vocabulary ones,
    the same on every rank. One MAX and one SUM all-reduce of O(T) values; none without TP."""
    if tp_size(group) == 1:
        return stats
    s_row = per_row(scale)
    local = torch.stack([stats.shift] + ([stats.sub_shift] if stats.sub_shift is not None else []))
    # MAX all-reduce over the tensor-parallel group: each rank's maxima over its vocab shard give
    # the full-vocab maxima, the shifts every rank's sums are moved to
    shifts = all_reduce_max_(local.clone(), group)
    moved = moved_stats(stats, finite_or_zero(shifts[0]),
                        finite_or_zero(shifts[1]) if stats.sub_shift is not None else None, s_row)
    columns = [t for t in (stats.marked, moved.rest, moved.moment, moved.sub_sum) if t is not None]
    # SUM all-reduce over the tensor-parallel group of one packed [T, k + c] tensor: the partial
    # sums over each rank's vocab shard add up to full-vocab sums, and the marked logits (0 on
    # the ranks not owning them) come back from their owners
    # (a rank may hold no row at all: its columns are [0] or [0, k], which reshape(0, -1) cannot size)
    summed = all_reduce_sum_(torch.cat([c.flatten(1) if c.dim() > 1 else c[:, None] for c in columns], dim=1), group)
    k = stats.marked.size(1)
    sums = iter(summed[:, k:].unbind(1))
    return RowStats(
        shift=shifts[0], marked=summed[:, :k],
        rest=next(sums) if stats.rest is not None else None,
        moment=next(sums) if stats.moment is not None else None,
        sub_shift=shifts[1] if stats.sub_shift is not None else None,
        sub_sum=next(sums) if stats.sub_sum is not None else None,
    )


# ----------------------------------------------------------------------------- finalize


@dataclass
class LogProbOutputs:
    """Per token: log p(target) (over the kept ids when masked), the entropy's Ā = E_p[u] (H =
    log S - Ā; saving Ā, not H, keeps log p + H = u - Ā exact for near-uniform rows), and the
    statistics backward needs. Without a mask the kept shift and log-sum are the full ones."""

    log_probs: torch.Tensor | None  # None: rebuilt from what backward saved
    shift: torch.Tensor | None
    log_s: torch.Tensor | None
    mean: torch.Tensor | None
    shift_kept: torch.Tensor
    log_s_kept: torch.Tensor

    @property
    def entropy(self) -> torch.Tensor:
        assert self.log_s is not None and self.mean is not None  # the entropy needs the moment summed
        return self.log_s - self.mean


def log_prob_outputs(stats: RowStats, scale: float | torch.Tensor) -> LogProbOutputs:
    """Log-probs and entropy from combined statistics whose one marked column is the target."""
    s_row = per_row(scale)
    x_t = stats.marked[:, 0]
    shift = stats.safe_shift
    u_t = (x_t - shift) * s_row
    assert stats.rest is not None  # the target's statistics always sum the rest
    log_s = torch.logaddexp(stats.rest.log(), u_t)  # S = S_other + e^u_t: log p stays exact as p -> 1
    log_p = u_t - log_s
    mean = None
    if stats.moment is not None:
        p_t = log_p.exp()
        mean = stats.moment * (-log_s).exp() + torch.where(p_t > 0, p_t * u_t, 0.0)
    if stats.sub_sum is None:
        return LogProbOutputs(log_p, shift, log_s, mean, shift, log_s)
    assert stats.sub_shift is not None  # kept with sub_sum
    shift_kept = finite_or_zero(stats.sub_shift)
    u_kt = (x_t - shift_kept) * s_row
    log_s_kept = torch.logaddexp(stats.sub_sum.log(), u_kt)
    return LogProbOutputs(u_kt - log_s_kept, shift, log_s, mean, shift_kept, log_s_kept)


@dataclass
class TopkOutputs:
    """Log-probs at the ids [T, k], the log tail mass [T], and what backward needs: the full
    shift and log-sum, the tail's own shift and log-sum."""

    logp: torch.Tensor
    tail: torch.Tensor | None  # None: rebuilt from what backward saved
    shift: torch.Tensor
    log_sum: torch.Tensor
    tail_shift: torch.Tensor
    log_tail_sum: torch.Tensor


def topk_outputs(stats: RowStats, scale: float | torch.Tensor, valid: torch.Tensor | None = None) -> TopkOutputs:
    """(k+1) buckets from combined statistics whose marked columns are the ids and whose subset is
    the tail (every other column): the tail is summed with its own max as shift, so its log-mass
    stays exact down to any size (never log(1 - Σp)). Slots not `valid` (padding of a masked ids
    tensor, never marked: their column's mass is in the tail) get log-prob -inf."""
    assert stats.sub_shift is not None and stats.sub_sum is not None  # the tail is the subset
    shift, tail_shift = stats.safe_shift, finite_or_zero(stats.sub_shift)
    u_ids = (stats.marked - shift.unsqueeze(1)) * scale
    if valid is not None:
        u_ids = u_ids.masked_fill(~valid, -math.inf)
    tail_offset = (tail_shift - shift) * per_row(scale)
    log_tail_sum = stats.sub_sum.log()
    log_sum = torch.logaddexp(log_tail_sum + tail_offset, torch.logsumexp(u_ids, dim=1))
    return TopkOutputs(u_ids - log_sum.unsqueeze(1), tail_offset + log_tail_sum - log_sum, shift, log_sum,
                       tail_shift, log_tail_sum)


# ----------------------------------------------------------------------------- gradient


@dataclass
class GradFactors:
    """Per-row factors of every op's backward, scale included. For an unmarked column j of a tile:

        dL/dx_j = e^(u_j - L)·(alpha + beta·max(u_j, NEG_FLOOR)) + gamma·[j in S]·e^(u'_j - L')

    with u = (x - shift)·s, u' = (x - sub_shift)·s and S the subset (keep mask; None: every
    column). At a marked column i (target, ids) the exact value

        dL/dx_i = e^(u_i - L)·(mark_alpha_i + beta·max(u_i, NEG_FLOOR)) - eta_i·expm1(u'_i - L') + delta_i

    replaces it (-expm1 keeps 1 - p exact as p -> 1; u' and L' are u and L without a subset).
    Unused terms are None (alpha None: no e^(u - L) term at all).
    """

    cols: torch.Tensor  # [T, k] local columns of the marked ids
    owned: torch.Tensor  # [T, k] whether this rank holds them
    shift: torch.Tensor | None = None
    log_sum: torch.Tensor | None = None
    alpha: torch.Tensor | None = None
    mark_alpha: torch.Tensor | None = None  # [T, k]
    beta: torch.Tensor | None = None
    sub_shift: torch.Tensor | None = None
    log_sub_sum: torch.Tensor | None = None
    gamma: torch.Tensor | None = None
    eta: torch.Tensor | None = None  # [T, k]
    delta: torch.Tensor | None = None  # [T, k]

    @property
    def dtype(self) -> torch.dtype:
        log_sum = self.log_sum if self.log_sum is not None else self.log_sub_sum
        assert log_sum is not None  # some exp term is always there
        return log_sum.dtype

    def rows(self, rows: slice | torch.Tensor) -> GradFactors:
        """The factors of some rows."""
        return replace(self, **{f.name: getattr(self, f.name)[rows] for f in fields(self)
                                if getattr(self, f.name) is not None})


def log_prob_grad_factors(out: LogProbOutputs, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                          scale: float | torch.Tensor, cols: torch.Tensor, owned: torch.Tensor,
                          masked: bool) -> GradFactors:
    """dL/dx = a·(onehot - p_kept) - b·p·(log p + H), a = s·dL/dlogp, b = s·dL/dH; the target's
    own entry a·(1 - p_kept) - b·p_t·(u_t - Ā) exact."""
    s_row = per_row(scale)
    dtype = out.log_s_kept.dtype
    a = grad_log_probs.to(dtype) * s_row if grad_log_probs is not None else None
    b = grad_entropy.to(dtype) * s_row if grad_entropy is not None else None
    alpha = None
    if b is not None:
        assert out.mean is not None  # the entropy's grad needs the moment
        alpha = b * out.mean  # -b·p·(u - Ā) = p·(b·Ā - b·u)
    mark_alpha = alpha
    if a is not None and not masked:  # p_kept = p: -a·p joins the e^(u - L) term
        alpha = -a if alpha is None else alpha - a
        mark_alpha = mark_alpha if mark_alpha is not None else torch.zeros_like(a)
    full = alpha is not None
    return GradFactors(
        cols=cols[:, None], owned=owned[:, None],
        shift=out.shift if full else None, log_sum=out.log_s if full else None,
        alpha=alpha, mark_alpha=mark_alpha[:, None] if mark_alpha is not None else None,
        beta=-b if b is not None else None,
        sub_shift=out.shift_kept if masked else None, log_sub_sum=out.log_s_kept if masked else None,
        gamma=-a if a is not None and masked else None,  # -a·p_kept on the kept ids, their own shift
        eta=a[:, None] if a is not None else None,
    )


def topk_grad_factors(out: TopkOutputs, grad_logp: torch.Tensor | None, grad_tail: torch.Tensor | None,
                      scale: float | torch.Tensor, cols: torch.Tensor, owned: torch.Tensor) -> GradFactors:
    """dlogp_i/dz_j = [i == j] - p_j; dtail/dz_j = [j in tail]·p_j/P_tail - p_j; dz/dx = s. An
    empty tail (log mass -inf) is a constant: no gradient."""
    s_row = per_row(scale)
    dtype = out.shift.dtype
    grad_ids = grad_logp.to(dtype) if grad_logp is not None else torch.zeros_like(out.logp)
    g_tail = tail_shift = log_tail_sum = None
    if grad_tail is not None:
        # an empty tail's rows borrow the full shift and log-sum, so its (zero-weighted) term stays finite
        empty = torch.isneginf(out.log_tail_sum)
        g_tail = torch.where(empty, 0.0, grad_tail.to(dtype))
        tail_shift = torch.where(empty, out.shift, out.tail_shift)
        log_tail_sum = torch.where(empty, out.log_sum, out.log_tail_sum)
    total = grad_ids.sum(dim=1) + (g_tail if g_tail is not None else 0.0)
    alpha = -total * s_row
    s_col = s_row[:, None] if isinstance(s_row, torch.Tensor) else s_row
    return GradFactors(
        cols=cols, owned=owned, shift=out.shift, log_sum=out.log_sum, alpha=alpha,
        mark_alpha=alpha[:, None].expand_as(grad_ids), delta=grad_ids * s_col,
        sub_shift=tail_shift, log_sub_sum=log_tail_sum, gamma=g_tail * s_row if g_tail is not None else None,
    )


def tile_grad(x: torch.Tensor, first_col: int, scale: float | torch.Tensor, f: GradFactors,
              subset: torch.Tensor | None) -> torch.Tensor:
    """dL/dx of one recomputed tile x [r, c] (columns from `first_col`) with the factors `f` of its
    rows (:class:`GradFactors`), in the factors' dtype. `subset` [r, c]: the kept ids, or None."""
    dtype = f.dtype
    buf = torch.empty(x.shape, dtype=dtype, device=x.device)
    dz = None
    if f.alpha is not None:
        assert f.shift is not None and f.log_sum is not None  # set with alpha
        u = shifted_rows(x, f.shift, scale, out=buf)
        dz = torch.exp(u - f.log_sum[:, None])
        dz.mul_(f.alpha[:, None] if f.beta is None else f.alpha[:, None] + f.beta[:, None] * u.clamp_min(NEG_FLOOR))
    if f.gamma is not None:
        assert f.sub_shift is not None and f.log_sub_sum is not None  # set with gamma
        sub = shifted_rows(x, f.sub_shift, scale, out=buf).sub_(f.log_sub_sum[:, None]).exp_()
        if subset is not None:
            sub.masked_fill_(~subset, 0.0)
        sub.mul_(f.gamma[:, None])
        dz = sub if dz is None else dz.add_(sub)
    if dz is None:
        dz = buf.zero_()
    local, inside, value = marked_entries(x, first_col, scale, f)
    # the marked entries replaced: cleared, then added (ids clamped onto a column add 0; a plain
    # scatter could let them overwrite a real mark, and an added difference would round)
    dz.masked_fill_(marks_mask(dz.shape, local, inside), 0.0)
    dz.scatter_add_(1, local, torch.where(inside, value, 0.0))
    return dz


def marked_entries(x: torch.Tensor, first_col: int, scale: float | torch.Tensor,
                   f: GradFactors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The marked columns of a tile x whose first column is `first_col` (`local`, `inside`: see
    :func:`column_marks`) and their exact gradient [r, k], read from x: call it before anything
    writes a gradient into x's storage. With `first_col` 0 and x every valid column of a source of
    whole rows, once per call for every tile."""
    local, inside = column_marks(f.cols, f.owned, first_col, x.size(1))
    return local, inside, marked_grad(x.gather(1, local).to(f.dtype), scale, f)


def marked_grad(x_m: torch.Tensor, scale: float | torch.Tensor, f: GradFactors) -> torch.Tensor:
    """dL/dx at the marked columns [r, k] from their logits `x_m` (see :class:`GradFactors`)."""
    value = torch.zeros_like(x_m)
    if f.mark_alpha is not None:
        assert f.shift is not None and f.log_sum is not None  # set with mark_alpha
        u_m = (x_m - f.shift[:, None]) * scale
        coef = f.mark_alpha if f.beta is None else f.mark_alpha + f.beta[:, None] * u_m.clamp_min(NEG_FLOOR)
        value = torch.exp(u_m - f.log_sum[:, None]) * coef
    if f.eta is not None:
        sub_shift, log_sub = (f.sub_shift, f.log_sub_sum) if f.sub_shift is not None else (f.shift, f.log_sum)
        assert sub_shift is not None and log_sub is not None  # eta comes with one of the two
        value = value - f.eta * torch.expm1((x_m - sub_shift[:, None]) * scale - log_sub[:, None])
    if f.delta is not None:
        value = value + f.delta
    return value
