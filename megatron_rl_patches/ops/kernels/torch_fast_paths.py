"""The torch backend's fast paths: the same statistics and gradients as the statistics core's
general steps (``_stats.fold_tile`` / ``_stats.tile_grad``) for the common calls, chosen once per
call (see :func:`target_only`): each element exponentiated once per pass, in powers of 2 (exp2,
twice as fast as exp on CPU, AVX2 fp32; see :func:`base2`), no marks mask, into caller-owned
buffers. Their results equal the general steps' to the rounding of exp2 against exp (tests compare
both routes against float64). Only :mod:`.torch_tiles` runs them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rl_patches.ops._stats import (
    NEG_FLOOR,
    GradFactors,
    RowStats,
    finite_or_zero,
    local_row_max,
    marked_entries,
    moved,
    per_row,
    shifted_rows,
)

LOG2E = 1.0 / math.log(2.0)  # the fast paths exponentiate in powers of 2 (see base2)
LN2 = math.log(2.0)


def base2(scale: float | torch.Tensor) -> float | torch.Tensor:
    """The scale that turns shifted logits into powers of 2, e^((x - m)·s) = 2^((x - m)·s·log2 e):
    the specialized steps exponentiate with exp2, twice as fast as exp on CPU (AVX2, fp32)."""
    return scale * LOG2E


def tail_only(stats: RowStats) -> bool:
    """Whether a fold sums only the complement of the marked ids (the top-k tail) and no rest:
    the top-k log-prob op, which :func:`fold_tail_tile` serves."""
    return stats.rest is None and stats.sub_shift is not None


def target_only(stats: RowStats | GradFactors) -> bool:
    """Whether a call has one marked column per row (the target) and no subset: the log-prob op
    without keep_mask, which the specialized steps serve."""
    if isinstance(stats, RowStats):
        return stats.marked.size(1) == 1 and stats.rest is not None and stats.sub_shift is None
    return (stats.cols.size(1) == 1 and stats.alpha is not None and stats.gamma is None and stats.delta is None
            and stats.sub_shift is None)


def replace_marked(tile: torch.Tensor, local: torch.Tensor, inside: torch.Tensor, value: torch.Tensor | float) -> None:
    """tile[row, local] = value where `inside`, in place; one column per row (k = 1), so the
    entries not inside are written back unchanged and no mask is built."""
    if not isinstance(value, torch.Tensor):
        value = torch.full(local.shape, value, dtype=tile.dtype, device=tile.device)
    tile.scatter_(1, local, torch.where(inside, value.to(tile.dtype), tile.gather(1, local)))


def fold_target_tile(stats: RowStats, rows: slice, x: torch.Tensor, scale: float | torch.Tensor,
                     marks: tuple[torch.Tensor, torch.Tensor], u: torch.Tensor, exps: torch.Tensor) -> None:
    """:func:`fold_tile` for one marked column (the target) and no subset, in the buffers `u` and
    `exps` (x's shape, the stats' dtype; `u` may be x's own storage: x is read first). The
    target's u becomes NEG_FLOOR, so it drops out of the sums (e^u = 0) without a mask."""
    dtype = stats.shift.dtype
    s_row = per_row(scale)
    local, inside = marks
    assert stats.rest is not None  # target_only
    stats.marked[rows] += torch.where(inside, x.gather(1, local).to(dtype), 0.0)
    old = stats.shift[rows]
    new_shift = torch.maximum(old, local_row_max(x, dtype))
    log_factor, factor = moved(old, finite_or_zero(new_shift), s_row)
    shifted_rows(x, finite_or_zero(new_shift), base2(scale), out=u)
    replace_marked(u, local, inside, NEG_FLOOR)
    torch.exp2(u, out=exps)
    if stats.moment is not None:
        # Σ e^u·u = ln 2·Σ 2^u2·u2, the product written over u: no fresh tile-sized temporary (a
        # large allocation is fresh pages, faulted in each time). -inf logits give 0·(-inf) =
        # NaN: nansum counts them as the 0 they are (no clamping pass; NaN logits are bad rows,
        # raised by the call)
        moment = torch.mul(exps, u, out=u).nansum(dim=1).mul_(LN2)
        stats.moment[rows] = factor * (stats.moment[rows] + stats.rest[rows] * log_factor) + moment
    stats.rest[rows] = stats.rest[rows] * factor + exps.sum(dim=1)
    stats.shift[rows] = new_shift


def target_tile_grad(x: torch.Tensor, first_col: int, scale: float | torch.Tensor, f: GradFactors,
                     out: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """:func:`tile_grad` for :func:`target_only` factors, written into `out` (x's shape; may be
    x's own storage); `u` a buffer of x's shape, needed only with an entropy term (beta)."""
    # the marks read before out (maybe x) is written
    return target_rows_grad(x, scale, TargetRows.of(f, *marked_entries(x, first_col, scale, f)), out, u)


@dataclass
class TargetRows:
    """What :func:`target_rows_grad` needs of some rows: their shift, their :class:`GradFactors`
    alpha and beta divided by the row's Σe^u (`alpha_s`, `beta_s`), the target's column in the
    tile (`local`, `inside`: see :func:`column_marks`) and its exact gradient `value` [r, 1].
    Sliced per tile by `rows`."""

    shift: torch.Tensor
    alpha_s: torch.Tensor
    beta_s: torch.Tensor | None
    local: torch.Tensor
    inside: torch.Tensor
    value: torch.Tensor

    @classmethod
    def of(cls, f: GradFactors, local: torch.Tensor, inside: torch.Tensor, value: torch.Tensor) -> TargetRows:
        assert f.alpha is not None and f.shift is not None and f.log_sum is not None  # target_only
        inv_sum = torch.exp(-f.log_sum)  # in (0, 1]: the max's own e^0 is in the sum
        return cls(f.shift, f.alpha * inv_sum, None if f.beta is None else f.beta * inv_sum, local, inside, value)

    def rows(self, rows: slice) -> TargetRows:
        return TargetRows(self.shift[rows], self.alpha_s[rows], None if self.beta_s is None else self.beta_s[rows],
                          self.local[rows], self.inside[rows], self.value[rows])


def target_rows_grad(x: torch.Tensor, scale: float | torch.Tensor, t: TargetRows, out: torch.Tensor,
                     u: torch.Tensor | None) -> torch.Tensor:
    """The body of :func:`target_tile_grad` with the target's column and gradient given (read
    from x before `out`, maybe x's storage, is written): e^u·(alpha + beta·u)/Σe^u as
    e^u·(alpha_s + beta_s·u), the sum folded into the row factors. One pass fewer than e^(u - L),
    and closer: e^u is exact to the exp's ulp, while rounding u - L costs up to |u - L| ulps."""
    if t.beta_s is None:
        shifted_rows(x, t.shift, base2(scale), out=out).exp2_().mul_(t.alpha_s[:, None])
    else:
        assert u is not None  # the entropy term needs u apart from the exps
        torch.exp2(shifted_rows(x, t.shift, base2(scale), out=u), out=out)
        out.mul_(u.clamp_min_(NEG_FLOOR).mul_(t.beta_s[:, None] * LN2).add_(t.alpha_s[:, None]))
    replace_marked(out, t.local, t.inside, t.value)
    return out


def fold_target_rows(stats: RowStats, rows: slice, x: torch.Tensor, scale: float | torch.Tensor,
                     marks: tuple[torch.Tensor, torch.Tensor], u: torch.Tensor, exps: torch.Tensor) -> None:
    """:func:`fold_target_tile` for a tile of whole rows that no other tile holds (a logits
    source) and whose marked logits are already in ``stats.marked``: the rows start empty, so
    nothing is moved and the sums are written in place; the same bits as the running fold."""
    assert stats.rest is not None  # target_only
    local, inside = marks
    row_max = local_row_max(x, stats.shift.dtype)
    shifted_rows(x, finite_or_zero(row_max), base2(scale), out=u)
    replace_marked(u, local, inside, NEG_FLOOR)
    torch.exp2(u, out=exps)
    if stats.moment is not None:  # as in fold_target_tile
        torch.nansum(torch.mul(exps, u, out=u), dim=1, out=stats.moment[rows])
        stats.moment[rows] *= LN2
    torch.sum(exps, dim=1, out=stats.rest[rows])
    stats.shift[rows] = row_max


def fold_tail_rows(stats: RowStats, rows: slice, x: torch.Tensor, scale: float | torch.Tensor,
                   marks: tuple[torch.Tensor, torch.Tensor], marked_max: torch.Tensor, u: torch.Tensor) -> None:
    """:func:`fold_tail_tile` for a tile of whole rows that no other tile holds (a logits source)
    whose marked logits are already in ``stats.marked`` and whose largest owned marked logit is
    `marked_max` [r]: nothing is moved; the same bits as the running fold."""
    assert stats.sub_shift is not None and stats.sub_sum is not None  # tail_only
    local, inside = marks
    u.copy_(x)
    u.scatter_reduce_(1, local, torch.where(inside, -math.inf, math.inf).to(u.dtype), reduce="amin")
    tail_max = local_row_max(u, stats.shift.dtype)
    stats.shift[rows] = torch.maximum(tail_max, marked_max)
    stats.sub_shift[rows] = tail_max
    torch.sum(shifted_rows(u, finite_or_zero(tail_max), base2(scale), out=u).exp2_(), dim=1, out=stats.sub_sum[rows])


def fold_tail_tile(stats: RowStats, rows: slice, x: torch.Tensor, scale: float | torch.Tensor,
                   marks: tuple[torch.Tensor, torch.Tensor], u: torch.Tensor) -> None:
    """:func:`fold_tile` for :func:`tail_only` statistics (the subset: every unmarked column), in
    the buffer `u` (x's shape, the stats' dtype): x copied once with its marked columns set to
    -inf, so one max and one exp serve the tail; the full max from the tail's and the marks'."""
    dtype = stats.shift.dtype
    s_row = per_row(scale)
    local, inside = marks
    assert stats.sub_shift is not None and stats.sub_sum is not None  # tail_only
    x_m = x.gather(1, local).to(dtype)
    stats.marked[rows] += torch.where(inside, x_m, 0.0)
    u.copy_(x)
    # marked columns to -inf; ids of other tiles (clamped onto a column) leave it as is, in any order
    u.scatter_reduce_(1, local, torch.where(inside, -math.inf, math.inf).to(dtype), reduce="amin")
    tail_max = local_row_max(u, dtype)
    marked_max = local_row_max(torch.where(inside, x_m, -math.inf), dtype)
    stats.shift[rows] = torch.maximum(stats.shift[rows], torch.maximum(tail_max, marked_max))
    new_shift = torch.maximum(stats.sub_shift[rows], tail_max)
    _, factor = moved(stats.sub_shift[rows], finite_or_zero(new_shift), s_row)
    shifted_rows(u, finite_or_zero(new_shift), base2(scale), out=u).exp2_()
    stats.sub_sum[rows] = stats.sub_sum[rows] * factor + u.sum(dim=1)
    stats.sub_shift[rows] = new_shift


def buffered_tile_grad(x: torch.Tensor, first_col: int, scale: float | torch.Tensor, f: GradFactors,
                       out: torch.Tensor, u: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """:func:`tile_grad` without a subset (keep mask), written into `out` (maybe x's own storage)
    with the buffers `u` and `sub` (all x's shape, the factors' dtype), the marked entries
    cleared by a scatter instead of a [r, c] marks mask; the top-k tail's two terms share one exp."""
    local, inside, value = marked_entries(x, first_col, scale, f)  # x is read before out is written
    return marked_rows_grad(x, scale, f, (local, inside), value, out, u, sub)


def marked_rows_grad(x: torch.Tensor, scale: float | torch.Tensor, f: GradFactors,
                     marks: tuple[torch.Tensor, torch.Tensor], value: torch.Tensor, out: torch.Tensor, u: torch.Tensor,
                     sub: torch.Tensor) -> torch.Tensor:
    """The body of :func:`buffered_tile_grad` with the marked columns (`marks`, see
    :func:`column_marks`) and their exact gradient `value` given (read from x before `out`,
    maybe x's storage, is written)."""
    local, inside = marks
    if f.gamma is not None and f.alpha is not None and f.beta is None:
        tail_grad(x, scale, f, (local, inside), out)  # the top-k tail: one exp per element
    else:
        _exp_terms(x, scale, f, out, u, sub)
    # marked entries to 0 (a product with 0; ids clamped from other tiles multiply by 1), then added
    out.scatter_reduce_(1, local, torch.where(inside, 0.0, 1.0).to(out.dtype), reduce="prod")
    out.scatter_add_(1, local, torch.where(inside, value, 0.0).to(out.dtype))
    return out


def _exp_terms(x: torch.Tensor, scale: float | torch.Tensor, f: GradFactors, out: torch.Tensor, u: torch.Tensor,
               sub: torch.Tensor) -> None:
    """The unmarked entries of :func:`buffered_tile_grad`: each exp term on its own shift."""
    if f.gamma is not None:
        assert f.sub_shift is not None and f.log_sub_sum is not None  # set with gamma
        log_sub = (f.log_sub_sum * LOG2E)[:, None]
        shifted_rows(x, f.sub_shift, base2(scale), out=sub).sub_(log_sub).exp2_().mul_(f.gamma[:, None])
    if f.alpha is not None:
        assert f.shift is not None and f.log_sum is not None  # set with alpha
        # e^(u - L)·(alpha + beta·u) as 2^u2·(alpha/S + beta·ln 2/S·u2), 1/S = e^-L folded into
        # the row factors (u2 <= 0: the shift is the row max), as in target_rows_grad
        inv_sum = torch.exp(-f.log_sum)
        torch.exp2(shifted_rows(x, f.shift, base2(scale), out=u), out=out)
        if f.beta is None:
            out.mul_((f.alpha * inv_sum)[:, None])
        else:
            out.mul_(u.clamp_min_(NEG_FLOOR).mul_((f.beta * LN2 * inv_sum)[:, None]).add_((f.alpha * inv_sum)[:, None]))
        if f.gamma is not None:
            out.add_(sub)
    elif f.gamma is not None:
        out.copy_(sub)
    else:
        out.zero_()


def tail_grad(x: torch.Tensor, scale: float | torch.Tensor, f: GradFactors, marks: tuple[torch.Tensor, torch.Tensor],
              out: torch.Tensor) -> torch.Tensor:
    """The unmarked entries alpha·p_j + gamma·p_j/P_tail of a top-k tile (the tail: every unmarked
    column) with one exp: p_j = P_tail·e^(u'_j)·e^(-L') with u'_j <= 0 there; the marked columns
    (`marks`, far above a far tail) are set to -inf before the exp, so nothing overflows. Their
    entries are 0, to be replaced. Written into `out` (maybe x's own storage)."""
    assert f.alpha is not None and f.shift is not None and f.log_sum is not None  # the full softmax
    assert f.gamma is not None and f.sub_shift is not None and f.log_sub_sum is not None  # the tail
    local, inside = marks
    tail_mass = ((f.sub_shift - f.shift) * per_row(scale) + f.log_sub_sum - f.log_sum).exp_()
    coef = tail_mass.mul_(f.alpha).add_(f.gamma).mul_(torch.exp(-f.log_sub_sum))  # e^-L' folded in: no pass
    u = shifted_rows(x, f.sub_shift, base2(scale), out=out)
    # marked columns to -inf; ids of other tiles (clamped onto a column) leave it as is
    u.scatter_reduce_(1, local, torch.where(inside, -math.inf, math.inf).to(u.dtype), reduce="amin")
    return u.exp2_().mul_(coef[:, None])
