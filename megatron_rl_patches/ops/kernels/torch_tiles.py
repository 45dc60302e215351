"""The torch backend: tiles of torch ops on any device (the CPU path and the reference).

Logits sources are walked in row chunks of whole rows; hidden-state sources in (row × vocab)
tiles x = h·Wᵀ computed on the fly, never [T, V]. Each tile is folded into the row statistics
(forward) or turned into dL/dx by the shared formula (backward, tile recomputed).
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from megatron_rl_patches.ops._stats import (
    GradFactors,
    RowStats,
    column_marks,
    fold_tile,
    local_row_max,
    marked_entries,
    scale_rows,
    tile_grad,
)
from megatron_rl_patches.ops._vocab import row_chunks
from megatron_rl_patches.ops.kernels.contract import Backend
from megatron_rl_patches.ops.kernels.sources import Source
from megatron_rl_patches.ops.kernels.torch_fast_paths import (
    TargetRows,
    buffered_tile_grad,
    fold_tail_rows,
    fold_tail_tile,
    fold_target_rows,
    fold_target_tile,
    marked_rows_grad,
    tail_only,
    target_only,
    target_rows_grad,
    target_tile_grad,
)
from megatron_rl_patches.ops.topk_select import RunningTopk, fold_tiles

# Bytes of one [rows, cols] fp32 logits tile of a hidden-state source. Rows are many so W's tile
# is reused across them (the matmuls run near peak); columns few enough that the 2-3 tile
# buffers stay small next to one copy of the logits.
CPU_TILE_BYTES = 8 << 20
CUDA_TILE_BYTES = 256 << 20
MAX_TILE_ROWS = 1024


def accumulate(grad_h: torch.Tensor | None, grad_w: torch.Tensor | None, dz: torch.Tensor, h: torch.Tensor,
               w: torch.Tensor, rows: slice, cols: slice, first_h: bool = False, first_w: bool = False) -> None:
    """grad_h[rows] += dz·w, grad_w[cols] += dzᵀ·h (matmuls in the inputs' dtype); `first_h` /
    `first_w`: that block is written for the first time (it may hold garbage), so the product is
    written into it, not added (no zero fill, no read of the old values: the same values)."""
    if h.dtype == dz.dtype:
        if grad_h is not None:
            _into(grad_h[rows], dz, w, first_h)
        if grad_w is not None:
            _into(grad_w[cols], dz.t(), h, first_w)
        return
    dz = dz.to(h.dtype)
    if grad_h is not None:
        _add_or_copy(grad_h[rows], torch.matmul(dz, w), first_h)
    if grad_w is not None:
        _add_or_copy(grad_w[cols], torch.matmul(dz.t(), h), first_w)


def _into(block: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """block = a·b when `first`, else block += a·b (one GEMM either way)."""
    if first:
        torch.mm(a, b, out=block)
    else:
        block.addmm_(a, b)


def _add_or_copy(block: torch.Tensor, value: torch.Tensor, first: bool) -> None:
    if first:
        block.copy_(value)
    else:
        block += value

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


def tiles(source: Source, dtype: torch.dtype) -> Iterator[tuple[slice, slice, torch.Tensor]]:
    """(rows, cols, x) for every tile of the source's valid columns."""
    n_rows, n_valid = source.n_rows, source.n_valid
    if n_valid == 0:  # a rank holding only vocabulary padding: no tile, nothing to fold
        return
    if not source.fused:
        assert source.logits is not None and source.chunk_rows is not None  # logits come with their chunk
        for r0, r1 in row_chunks(n_rows, source.chunk_rows):
            yield slice(r0, r1), slice(0, n_valid), source.logits[r0:r1, :n_valid]
        return
    assert source.hidden is not None and source.weight is not None  # fused
    row_tile, col_tile = tile_shape(source.shape_rows or n_rows, n_valid, source.hidden.device, source.chunk_rows)
    buf = torch.empty(row_tile, col_tile, dtype=dtype, device=source.hidden.device)
    for r0, r1 in row_chunks(n_rows, row_tile):
        h = source.hidden[r0:r1]
        for c0, c1 in row_chunks(n_valid, col_tile):
            yield slice(r0, r1), slice(c0, c1), logits_tile(h, source.weight[c0:c1], buf[: r1 - r0, : c1 - c0])


class TorchTiles(Backend):
    """The built-in backend: every device, every dtype."""

    name = "torch"
    divergence_pass1_on_tiles = True

    def available(self, device: torch.device) -> str | None:
        return None

    def claims(self, device: torch.device) -> bool:
        return True

    def row_stats(self, source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                  keep_mask: torch.Tensor | None, scale: float | torch.Tensor) -> RowStats:
        if keep_mask is None and target_only(stats):
            return _target_row_stats(source, stats, cols, owned, scale)
        if keep_mask is None and tail_only(stats):
            work = _TileBuffers(source, stats.shift.dtype, 1)
            if not source.fused and source.n_valid > 0:
                local, inside, x_m = _whole_row_marks(source, stats, cols, owned)
                marked_max = local_row_max(torch.where(inside, x_m, -math.inf), stats.shift.dtype)
                for rows, _, x in tiles(source, stats.shift.dtype):
                    fold_tail_rows(stats, rows, x, scale_rows(scale, rows), (local[rows], inside[rows]),
                                   marked_max[rows], work.get(0, x))
                return stats
            for rows, tile_cols, x in tiles(source, stats.shift.dtype):
                marks = column_marks(cols[rows], owned[rows], tile_cols.start, x.size(1))
                fold_tail_tile(stats, rows, x, scale_rows(scale, rows), marks, work.get(0, x))
            return stats
        for rows, tile_cols, x in tiles(source, stats.shift.dtype):
            marks = column_marks(cols[rows], owned[rows], tile_cols.start, x.size(1))
            subset = keep_mask[rows, tile_cols] if keep_mask is not None else None
            fold_tile(stats, rows, x, scale_rows(scale, rows), marks, subset)
        return stats

    def apply_grad(self, source: Source, factors: GradFactors, scale: float | torch.Tensor,
                   keep_mask: torch.Tensor | None, needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
        dtype = factors.dtype
        fast = keep_mask is None and target_only(factors)
        work = _TileBuffers(source, dtype, 3 if source.fused else 2 if keep_mask is None else 0)
        if not source.fused:
            assert source.logits is not None  # not fused
            # whole rows: the marked columns and their gradient taken once, before anything is written
            marked = None
            if keep_mask is None and source.n_valid > 0 and source.logits.dtype == dtype:
                marked = marked_entries(source.logits[:, : source.n_valid], 0, scale, factors)
            targets = TargetRows.of(factors, *marked) if fast and marked is not None else None
            grad = logits_grad_buffer(source)
            for rows, cols, x in tiles(source, dtype):
                if targets is not None:
                    u = work.get(0, x) if factors.beta is not None else None
                    target_rows_grad(x, scale_rows(scale, rows), targets.rows(rows), grad[rows, cols], u)
                    continue
                f = factors.rows(rows)
                if marked is not None:  # not target_only
                    marked_rows_grad(x, scale_rows(scale, rows), f, (marked[0][rows], marked[1][rows]),
                                     marked[2][rows], grad[rows, cols], work.get(0, x), work.get(1, x))
                    continue
                subset = keep_mask[rows, cols] if keep_mask is not None else None
                grad[rows, cols] = tile_grad(x, cols.start, scale_rows(scale, rows), f, subset)
            return (grad,)
        hidden, weight = source.hidden, source.weight
        assert hidden is not None and weight is not None  # fused
        # each block written first by its first tile's product, not zero-filled and added to (the
        # weight's gradient is the vocabulary's size); what no tile covers is zeroed
        grad_h = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if needs[0] else None
        grad_w = torch.empty(weight.shape, dtype=dtype, device=weight.device) if needs[1] else None
        _zero_uncovered(grad_h, grad_w, hidden.size(0), source.n_valid)
        for rows, cols, x in tiles(source, dtype):
            f = factors.rows(rows)
            if fast:
                # dL/dx written over x (the tiles' own buffer, read before: see target_tile_grad)
                dz = target_tile_grad(x, cols.start, scale_rows(scale, rows), f, x, work.get(1, x))
            elif keep_mask is None:
                dz = buffered_tile_grad(x, cols.start, scale_rows(scale, rows), f, work.get(0, x), work.get(1, x),
                                        work.get(2, x))
            else:
                subset = keep_mask[rows, cols] if keep_mask is not None else None
                dz = tile_grad(x, cols.start, scale_rows(scale, rows), f, subset)
            accumulate(grad_h, grad_w, dz, hidden[rows], weight[cols], rows, cols, first_h=cols.start == 0,
                       first_w=rows.start == 0)
        return grad_h, grad_w


    def topk(self, source: Source, run: RunningTopk, first_id: int) -> RunningTopk:
        if not source.fused:  # whole rows: one torch.topk over every row at once
            assert source.logits is not None  # not fused
            x = source.logits[:, : source.n_valid]
            return fold_tiles(run, iter([(slice(0, x.size(0)), slice(0, x.size(1)), x)]), first_id)
        return fold_tiles(run, tiles(source, run.values.dtype), first_id)


def _zero_uncovered(grad_h: torch.Tensor | None, grad_w: torch.Tensor | None, n_rows: int, n_valid: int) -> None:
    """Zero the gradients' parts no tile writes: the weight's padded rows (ids >= vocab_size), and
    everything when there is no tile (no row, or no valid column)."""
    empty = n_rows == 0 or n_valid == 0
    if grad_w is not None:
        (grad_w if empty else grad_w[n_valid:]).zero_()
    if grad_h is not None and empty:
        grad_h.zero_()


class _TileBuffers:
    """Up to `count` reusable tile-sized buffers of one call, each viewed contiguous at a tile's
    shape; each allocated when first asked for (a path that works in the tile itself needs fewer)."""

    def __init__(self, source: Source, dtype: torch.dtype, count: int) -> None:
        first = source.first
        if source.fused:
            rows, cols = tile_shape(source.shape_rows or source.n_rows, source.n_valid, first.device, source.chunk_rows)
        else:
            rows, cols = min(source.n_rows, source.chunk_rows or source.n_rows), source.n_valid
        self._numel, self._dtype, self._device = max(rows, 1) * max(cols, 1), dtype, first.device
        self._flat: list[torch.Tensor | None] = [None] * count

    def get(self, index: int, like: torch.Tensor) -> torch.Tensor:
        flat = self._flat[index]
        if flat is None:
            flat = self._flat[index] = torch.empty(self._numel, dtype=self._dtype, device=self._device)
        return flat[: like.numel()].view(like.shape)


def _target_row_stats(source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                      scale: float | torch.Tensor) -> RowStats:
    """The log-prob op's statistics through the specialized fold, in two reusable tile buffers."""
    dtype = stats.shift.dtype
    work = _TileBuffers(source, dtype, 2)
    if not source.fused and source.n_valid > 0:
        local, inside, _ = _whole_row_marks(source, stats, cols, owned)
        for rows, _, x in tiles(source, dtype):
            fold_target_rows(stats, rows, x, scale_rows(scale, rows), (local[rows], inside[rows]), work.get(0, x),
                             work.get(1, x))
        return stats
    for rows, tile_cols, x in tiles(source, dtype):
        marks = column_marks(cols[rows], owned[rows], tile_cols.start, x.size(1))
        # x is the tiles' own buffer: shifted in place (one buffer less, one tile less in cache)
        fold_target_tile(stats, rows, x, scale_rows(scale, rows), marks, x, work.get(1, x))
    return stats


def _whole_row_marks(source: Source, stats: RowStats, cols: torch.Tensor,
                     owned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A logits source holds whole rows in every tile, so its marked logits are gathered once for
    every row and added to ``stats.marked``, not tile by tile: (local column, inside, x_m)."""
    assert source.logits is not None  # not fused
    local, inside = column_marks(cols, owned, 0, source.n_valid)
    x_m = source.logits[:, : source.n_valid].gather(1, local).to(stats.shift.dtype)
    stats.marked += torch.where(inside, x_m, 0.0)
    return local, inside, x_m


def logits_grad_buffer(source: Source) -> torch.Tensor:
    """Where the logits' gradient goes: their own storage when allowed, else a fresh tensor;
    padded columns (ids >= vocab_size) get 0."""
    logits = source.logits
    assert logits is not None  # not fused
    if source.inplace:
        # the caller allowed us to overwrite the logits: bump their version so any other node
        # that saved them fails autograd's check instead of reading the gradient
        torch.autograd.graph.increment_version(logits)
        grad = logits.detach()
    else:
        grad = torch.empty_like(logits)
    if source.n_valid < logits.size(1):
        grad[:, source.n_valid :].zero_()
    return grad
