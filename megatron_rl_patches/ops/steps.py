"""The named steps every vocabulary op and every backend shares, public in one place: moving
running exp-sums to a new max (over tiles, vocabulary splits or ranks), accumulating dh/dW from a
tile's dL/dx, the saved temperature of a Function, and the bad-row check. Imports nothing of the
package at module level, so the statistics core, the backends and the ops can all use it."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron_rl_patches.ops._checks import DeviceChecks
    from megatron_rl_patches.ops._stats import RowStats

__all__ = ["moved", "moved_stats", "accumulate", "save_tau", "saved_scale", "require_good_rows"]


def moved(old: torch.Tensor, new_safe: torch.Tensor, s_row: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log factor, factor) moving sums taken at shift `old` to `new_safe`: (old - new)·s and its
    exp; (0, 0) where nothing was summed yet (old = -inf)."""
    started = torch.isfinite(old)
    log_factor = torch.where(started, (old - new_safe) * s_row, 0.0)
    return log_factor, torch.where(started, log_factor.exp(), 0.0)


def moved_stats(stats: RowStats, shift: torch.Tensor, sub_shift: torch.Tensor | None,
                s_row: float | torch.Tensor) -> RowStats:
    """`stats` with every exp-sum moved to the (finite or zero) shifts `shift` / `sub_shift`, which
    broadcast against them (a [T] max over splits [S, T], or the global max over ranks): summing
    moved statistics over splits or ranks merges them."""
    out = dataclasses.replace(stats, shift=shift)
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


def accumulate(grad_h: torch.Tensor | None, grad_w: torch.Tensor | None, dz: torch.Tensor, h: torch.Tensor,
               w: torch.Tensor, rows: slice, cols: slice) -> None:
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


def save_tau(ctx: Any, tau: float | torch.Tensor) -> torch.Tensor | None:
    """Keep a float temperature on `ctx`; return a tensor one for save_for_backward (else None)."""
    ctx.tau = None if isinstance(tau, torch.Tensor) else tau
    return tau if isinstance(tau, torch.Tensor) else None


def saved_scale(ctx: Any, tau_tensor: torch.Tensor | None, n_rows: int, dtype: torch.dtype) -> float | torch.Tensor:
    """The backward's 1/τ from what :func:`save_tau` kept."""
    from megatron_rl_patches.ops._stats import row_scale

    return row_scale(tau_tensor if tau_tensor is not None else ctx.tau, n_rows, dtype)


def require_good_rows(checks: DeviceChecks, shift: torch.Tensor, op: str, what: str, *,
                      kept_log_sum: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                      n_rows: int = 0) -> None:
    """Rows of `what` with NaN/+inf or no finite logit (from their combined max), or no finite kept
    logit (`kept_log_sum` -inf), join the call's checks, raised at its one host sync; with `rows`
    (the selected rows of `n_rows`) they are named by their row of all."""
    from megatron_rl_patches.ops._checks import BAD_KEPT_NEG_INF, bad_row_codes, bad_rows_error
    from megatron_rl_patches.ops._rows import scatter_rows

    bad = bad_row_codes(shift)
    if kept_log_sum is not None:
        bad = torch.where((bad == 0) & torch.isneginf(kept_log_sum), BAD_KEPT_NEG_INF, bad)
    bad = scatter_rows(bad, rows, n_rows)
    checks.require(bad == 0, lambda: bad_rows_error(op, what, bad))
