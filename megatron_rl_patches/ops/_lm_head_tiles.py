"""Tile walks of the fused LM head: logits tiles z = h·Wᵀ computed on the fly, never [T, V].

Statistics are kept in raw logit units with a per-row shift (the running max, online-softmax
style), so u = (x − shift)·s (s = 1/τ) is formed by subtracting before scaling, as the logits
ops do. Everything here is local to one rank; the ops combine ranks with one MAX and one SUM.
"""
from __future__ import annotations

import math

import torch

from megatron_rl_patches.ops._vocab import NEG_FLOOR, local_row_max, shifted_rows

# Bytes of one [rows, cols] fp32 logits tile. Rows are many so W's tile is reused across them
# (the matmuls run near peak); columns few enough that the 2-3 tile buffers stay small next to
# one copy of the logits.
CPU_TILE_BYTES = 8 << 20
CUDA_TILE_BYTES = 256 << 20
MAX_TILE_ROWS = 1024


def tile_shape(n_rows: int, n_cols: int, device: torch.device, chunk_rows: int | None) -> tuple[int, int]:
    """(rows, cols) of a logits tile: `chunk_rows` rows (or up to MAX_TILE_ROWS), columns to fill the budget."""
    budget = CUDA_TILE_BYTES if device.type == "cuda" else CPU_TILE_BYTES
    rows = max(1, min(n_rows, chunk_rows or MAX_TILE_ROWS))
    cols = max(1, min(max(n_cols, 1), budget // (4 * rows)))
    return rows, cols


def logits_tile(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x = h·wᵀ in the inputs' dtype, returned in the compute dtype (`out`'s)."""
    if h.dtype == out.dtype:
        return torch.matmul(h, w.t(), out=out)
    out.copy_(torch.matmul(h, w.t()))
    return out


class RowStats:
    """Per-row running statistics over column tiles (local to this rank), raw units:
    shift = running max of x, rest = Σ e^u over unmarked columns, moment = Σ e^u·u over them
    (u = (x - shift)·s), with an optional column subset (kept ids / tail) holding its own shift."""

    def __init__(self, n_rows: int, dtype: torch.dtype, device: torch.device, moment: bool, subset: bool):
        full = lambda value: torch.full((n_rows,), value, dtype=dtype, device=device)  # noqa: E731
        self.shift = full(-math.inf)
        self.rest = full(0.0)
        self.moment = full(0.0) if moment else None
        self.sub_shift = full(-math.inf) if subset else None
        self.sub_sum = full(0.0) if subset else None

    def add(self, rows: slice, x: torch.Tensor, scale, marked: torch.Tensor | None, subset: torch.Tensor | None,
            buf: torch.Tensor) -> None:
        """Fold one tile x [r, c] in. `marked` [r, c] bool: columns left out of rest, moment and
        the subset sum (the targets, the top-k ids); `subset` [r, c] bool: the subset's columns
        (its max counts marked ones too). -inf columns add nothing; NaN/+inf rows show up as a
        +inf shift, which the caller reports."""
        row_scale = scale.squeeze(1) if isinstance(scale, torch.Tensor) else scale  # [r] or a float
        self._fold_unmarked(rows, x, scale, row_scale, marked, buf)
        if self.sub_shift is not None:
            self._fold_subset(rows, x, scale, row_scale, marked, subset, buf)

    def _fold_unmarked(self, rows: slice, x: torch.Tensor, scale, row_scale, marked: torch.Tensor | None,
                       buf: torch.Tensor) -> None:
        """rest and moment over the unmarked columns, moved to the new running max."""
        old_shift = self.shift[rows]
        new_shift = torch.maximum(old_shift, local_row_max(x, x.dtype))
        safe_shift = torch.where(torch.isfinite(new_shift), new_shift, 0.0)
        log_factor = _log_factor(old_shift, safe_shift, row_scale)
        factor = torch.where(torch.isfinite(old_shift), log_factor.exp(), 0.0)
        shifted = shifted_rows(x, safe_shift, scale, out=buf)
        exps = torch.exp(shifted)
        if marked is not None:
            exps.masked_fill_(marked, 0.0)
        if self.moment is not None:
            moment = (exps * shifted.clamp_min_(NEG_FLOOR)).sum(dim=1)
            self.moment[rows] = factor * (self.moment[rows] + self.rest[rows] * log_factor) + moment
        self.rest[rows] = self.rest[rows] * factor + exps.sum(dim=1)
        self.shift[rows] = new_shift

    def _fold_subset(self, rows: slice, x: torch.Tensor, scale, row_scale, marked: torch.Tensor | None,
                     subset: torch.Tensor, buf: torch.Tensor) -> None:
        """The subset's exp-sum with its own running max (the marked columns count for the max)."""
        subset_x = x.masked_fill(~subset, -math.inf)
        old_shift = self.sub_shift[rows]
        new_shift = torch.maximum(old_shift, local_row_max(subset_x, x.dtype))
        safe_shift = torch.where(torch.isfinite(new_shift), new_shift, 0.0)
        factor = torch.where(torch.isfinite(old_shift), _log_factor(old_shift, safe_shift, row_scale).exp(), 0.0)
        exps = shifted_rows(subset_x, safe_shift, scale, out=buf).exp_()
        if marked is not None:
            exps.masked_fill_(marked, 0.0)
        self.sub_sum[rows] = self.sub_sum[rows] * factor + exps.sum(dim=1)
        self.sub_shift[rows] = new_shift


def _log_factor(old: torch.Tensor, new: torch.Tensor, scale) -> torch.Tensor:
    """(old - new)·s, 0 where nothing was summed yet (old = -inf)."""
    return torch.where(torch.isfinite(old), (old - new) * scale, 0.0)
