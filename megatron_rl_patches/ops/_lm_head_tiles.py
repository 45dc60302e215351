"""Tile walks of the fused LM head: logits tiles z = h·Wᵀ computed on the fly, never [T, V].

Statistics are kept in raw logit units with a per-row shift (the running max, online-softmax
style), so u = (x − shift)·s (s = 1/τ) is formed by subtracting before scaling, as the logits
ops do. Everything here is local to one rank; the ops combine ranks with one MAX and one SUM.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

NEG_FLOOR = -1.0e4  # exp of anything below is 0 in fp32/fp64; keeps 0·(-inf) out of q·u

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


def spans(n: int, step: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, step):
        yield start, min(n, start + step)


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
        srow = scale.squeeze(1) if isinstance(scale, torch.Tensor) else scale  # [r] or a float
        old = self.shift[rows]
        new = torch.maximum(old, _row_max(x))
        safe = torch.where(torch.isfinite(new), new, 0.0)
        delta = _log_factor(old, safe, srow)
        factor = torch.where(torch.isfinite(old), delta.exp(), 0.0)
        u = _shifted(x, safe, scale, buf)
        e = torch.exp(u)
        if marked is not None:
            e.masked_fill_(marked, 0.0)
        if self.moment is not None:
            moment = (e * u.clamp_min_(NEG_FLOOR)).sum(dim=1)
            self.moment[rows] = factor * (self.moment[rows] + self.rest[rows] * delta) + moment
        self.rest[rows] = self.rest[rows] * factor + e.sum(dim=1)
        self.shift[rows] = new
        if self.sub_shift is not None:
            sub_x = x.masked_fill(~subset, -math.inf)
            sub_old = self.sub_shift[rows]
            sub_new = torch.maximum(sub_old, _row_max(sub_x))
            sub_safe = torch.where(torch.isfinite(sub_new), sub_new, 0.0)
            sub_factor = torch.where(torch.isfinite(sub_old), _log_factor(sub_old, sub_safe, srow).exp(), 0.0)
            sub_e = _shifted(sub_x, sub_safe, scale, buf).exp_()
            if marked is not None:
                sub_e.masked_fill_(marked, 0.0)
            self.sub_sum[rows] = self.sub_sum[rows] * sub_factor + sub_e.sum(dim=1)
            self.sub_shift[rows] = sub_new


def _row_max(x: torch.Tensor) -> torch.Tensor:
    """Per-row max with NaN mapped to +inf (so a MAX all-reduce keeps it)."""
    m = x.amax(dim=1)
    return torch.where(torch.isnan(m), math.inf, m)


def _shifted(x: torch.Tensor, shift: torch.Tensor, scale, out: torch.Tensor) -> torch.Tensor:
    """(x - shift)·s into `out`: subtracting first keeps entries near the max exact."""
    torch.sub(x, shift.unsqueeze(1), out=out)
    if isinstance(scale, torch.Tensor) or scale != 1.0:
        out.mul_(scale)
    return out


def _log_factor(old: torch.Tensor, new: torch.Tensor, scale) -> torch.Tensor:
    """(old - new)·s, 0 where nothing was summed yet (old = -inf)."""
    return torch.where(torch.isfinite(old), (old - new) * scale, 0.0)
