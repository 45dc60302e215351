"""The invariant mode's statistics: each row's values a function of that row's logits (or hidden
state and the weights) alone — the same bits whatever the other rows, the tensor-parallel split,
the sequence-parallel gather, the row selection or the chunk size.

Three means, each closing one way a row's bits could move:

- **fixed-shape GEMM tiles**: the fused head's h·Wᵀ runs on [R, H]·[H, W] tiles of one shape per
  device (hidden rows and the last vocabulary tile padded with zeros), so no GEMM's blocking
  depends on T, on the shard's width or on a row's position; the elementwise passes here are
  exp2, subtraction, multiplication and clamping only, which give an element the same bits
  wherever it sits (exp2 on CPU only over buffers walked in whole vector steps,
  :mod:`.whole_vectors`: its loop remainder would take another code path);
- **global maxima first**: a row's exponentials are taken against its full-vocabulary max (one
  MAX all-reduce per row group: all rows for logits, each group of row tiles for the fused head,
  whose tile logits stay in a [rows, V_local] buffer meanwhile), so no running sum is ever rescaled;
- **exact sums**: every e^u ≤ 1 (and e^u·u, u in powers of 2 for the log-prob sums) goes into
  64-bit fixed point (2^-44 units; rounded to nearest for the log-prob sums, truncated for a
  subset's) and is summed as integers, across tiles and across ranks: integer addition does not
  care about order, so neither the tiling nor the split shows.

The finalize steps then run in fixed row blocks (:mod:`..row_blocks`). :class:`InvariantTiles`
is these means as a backend of the contract (:mod:`.`): an op that resolved ``invariant=True``
takes its forward statistics and top-k ids from it unless the chosen backend has invariant
kernels of its own (``Backend.invariant_backend``: the Triton kernel, :mod:`.triton.invariant_backend`);
the gradients are the chosen backend's: exact, not bit-invariant.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megatron_rl_patches.ops._dist import all_reduce_max_, all_reduce_sum_, tp_size
from megatron_rl_patches.ops._stats import (
    NEG_FLOOR,
    RowStats,
    column_marks,
    finite_or_zero,
    local_row_max,
    marks_mask,
    scale_rows,
)
from megatron_rl_patches.ops.kernels.contract import Backend
from megatron_rl_patches.ops.kernels.sources import Source
from megatron_rl_patches.ops.kernels.torch_fast_paths import LN2, base2, replace_marked
from megatron_rl_patches.ops.kernels.whole_vectors import padded_rows, padded_width
from megatron_rl_patches.ops.row_blocks import in_row_blocks
from megatron_rl_patches.ops.topk_select import RunningTopk, Tiles, fold_tiles

T = TypeVar("T")

FIXED_BITS = 44  # e^u in [0, 1] as integers of 2^-44: below 2^19 ids a row sums below 2^63 (invariance.MAX_VOCAB)
_TO_FIXED = float(2 ** FIXED_BITS)
_FROM_FIXED = float(2.0 ** -FIXED_BITS)
# A fused source's logits held between the max pass and the sums (CPU): several row tiles, so that
# a weight tile read from memory serves each of them (the GEMMs' shape does not change)
GROUP_BYTES = 64 << 20


def tile_shape(device: torch.device) -> tuple[int, int]:
    """(rows, columns) of every tile on `device`: on CPU a multiple of every vector width, and rows
    enough that its GEMM runs near a whole-T one's speed (32 rows ran ~20 % slower; fewer rows than a
    tile still pay its GEMM); on CUDA elementwise kernels are per element."""
    return (256, 4096) if device.type == "cuda" else (256, 2048)


def _fixed_sum(t: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
    """Σ over the columns of values in [-1, 1] (t is overwritten; `ints` an int64 buffer of its
    shape), as int64 units of 2^-44 (truncated): exact, so the same in any order or grouping."""
    return ints.copy_(t.mul_(_TO_FIXED)).sum(dim=1)


# Values v in [-1, 1] plus 1.5·2^8 lie in [2^8, 2^9), whose doubles step by 2^-44: the double's
# bits as an integer are BITS + v in units of 2^-44 (rounded to nearest), one add after the copy.
_MAGIC = 384.0
_MAGIC_BITS = struct.unpack("<q", struct.pack("<d", _MAGIC))[0]


def _rounded_sum(t: torch.Tensor, doubles: torch.Tensor) -> torch.Tensor:
    """Σ over the columns of values in [-1, 1] (`doubles` a float64 buffer of t's shape) as
    int64 units of 2^-44, each value rounded to nearest: the integer sum of the doubles' bits,
    exact modulo 2^64 in any order (two's complement), less the columns' count of BITS."""
    sums = doubles.copy_(t).add_(_MAGIC).view(torch.int64).sum(dim=1)
    offset = (t.size(1) * _MAGIC_BITS) % (1 << 64)
    return sums.sub_(offset - (1 << 64) if offset >= 1 << 63 else offset)


class _Buffers:
    """Reusable work buffers of one call, viewed at each pass's shape (fresh pages cost a fault each)."""

    def __init__(self) -> None:
        self._flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._shaped(name, like.shape, dtype, like.device)

    def whole_vectors(self, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A buffer [rows, cols] ≥ `like`'s shape that torch's elementwise ops walk in whole
        vector steps (:mod:`.whole_vectors`); the caller uses its top-left `like`-shaped corner."""
        width = padded_width(like.size(1))
        return self._shaped(name, torch.Size((padded_rows(like.size(0), width), width)), dtype, like.device)

    def _shaped(self, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        flat = self._flat.get((name, dtype))
        if flat is None or flat.numel() < shape.numel():
            flat = self._flat[(name, dtype)] = torch.zeros(shape.numel(), dtype=dtype, device=device)
        return flat[: shape.numel()].view(shape)


class _Walk:
    """A source's rows in groups (the rows sharing one MAX all-reduce) and views of their logits:
    a logits source's whole rows (every pass here is exact or per element, whatever the view's
    shape); a fused source's fixed-shape GEMM tiles of one row tile, kept in a [n_tiles, R, W]
    buffer between the two passes."""

    def __init__(self, source: Source, dtype: torch.dtype) -> None:
        self.source, self.dtype = source, dtype
        device = source.first.device
        self.rows, self.cols = tile_shape(device)
        self.col_starts = list(range(0, source.n_valid, self.cols))
        if source.fused:
            assert source.hidden is not None and source.weight is not None  # fused
            weight = source.weight[: source.n_valid].contiguous()
            self.weight = weight
            self.last_weight = None
            last = source.n_valid - (self.col_starts[-1] if self.col_starts else 0)
            if self.col_starts and last < self.cols:  # the last vocabulary tile padded with zero rows
                self.last_weight = weight.new_zeros(self.cols, weight.size(1))
                self.last_weight[:last].copy_(weight[self.col_starts[-1]:])
            # row tiles per group: GEMMs of one vocabulary tile for every row tile of the group in a
            # row, so the weight tile is read from memory once per group (the GEMMs keep their shape)
            self.group_rows = self.rows * _row_tiles_per_group(source, device, self.rows)
            self.h = source.hidden.new_zeros(self.group_rows, source.hidden.size(1))
            # the real rows only: a last tile of fewer rows than a tile takes its GEMM's padded tile
            # through `scratch`; whole tiles go straight into the buffer
            buffer_rows = min(self.group_rows, source.n_rows)
            self.buffer = torch.empty(len(self.col_starts), buffer_rows, self.cols, dtype=dtype, device=device)
            self.scratch = torch.empty(self.rows, self.cols, dtype=dtype, device=device) \
                if buffer_rows < self.group_rows else None
        else:
            self.chunk = _logits_chunk_rows(source.n_valid, device)

    def groups(self) -> list[tuple[int, int]]:
        """Row ranges sharing one MAX all-reduce: every row for logits, each row tile when fused."""
        n_rows = self.source.n_rows
        if not self.source.fused:
            return [(0, n_rows)] if n_rows else []
        return [(r0, min(n_rows, r0 + self.group_rows)) for r0 in range(0, n_rows, self.group_rows)]

    def width(self, c0: int) -> int:
        return min(self.cols, self.source.n_valid - c0)

    def compute(self, r0: int, r1: int) -> None:
        """A fused source: every vocabulary tile of the group's rows [r0, r1) into the buffer, each
        GEMM of the one shape [R, H]·[H, W] (zero rows pad the hidden rows and the last vocabulary
        tile)."""
        assert self.source.hidden is not None  # fused
        if r1 - r0 < self.group_rows:
            self.h.zero_()
        self.h[: r1 - r0].copy_(self.source.hidden[r0:r1])
        row_tiles = [slice(t0, t0 + self.rows) for t0 in range(0, r1 - r0, self.rows)]
        for index, c0 in enumerate(self.col_starts):
            w = self.weight[c0: c0 + self.cols] if self.width(c0) == self.cols else self.last_weight
            assert w is not None  # a partial tile has its padded weight
            for tile in row_tiles:
                real = min(tile.stop, r1 - r0) - tile.start
                scratch = self.scratch if real < self.rows else None
                out = self.buffer[index, tile] if scratch is None else scratch
                if self.h.dtype == out.dtype:
                    torch.matmul(self.h[tile], w.t(), out=out)
                else:
                    out.copy_(torch.matmul(self.h[tile], w.t()))
                if scratch is not None:
                    self.buffer[index, tile.start: tile.start + real].copy_(scratch[:real])

    def views(self, g0: int, g1: int) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """(first row, last row + 1, first column, real entries [r, c]) covering rows [g0, g1)."""
        if not self.source.fused:
            assert self.source.logits is not None  # not fused
            if self.col_starts:
                for r0 in range(g0, g1, self.chunk):
                    r1 = min(g1, r0 + self.chunk)
                    yield r0, r1, 0, self.source.logits[r0:r1, : self.source.n_valid]
            return
        for index, c0 in enumerate(self.col_starts):
            yield g0, g1, c0, self.buffer[index, : g1 - g0, : self.width(c0)]


def _row_tiles_per_group(source: Source, device: torch.device, rows: int) -> int:
    """Row tiles per group of a fused source: its [rows·tiles, V_local] logits within
    GROUP_BYTES (fp32), at most as many as its rows fill; one on CUDA."""
    if device.type == "cuda":
        return 1
    most = max(1, GROUP_BYTES // (4 * rows * max(1, source.n_valid)))
    return max(1, min(most, -(-source.n_rows // rows)))


def _logits_chunk_rows(n_cols: int, device: torch.device) -> int:
    """Rows per pass over a logits source (any count gives the same bits): about 4 MiB of fp32."""
    budget = (128 << 20) if device.type == "cuda" else (4 << 20)
    return max(1, budget // (4 * max(1, n_cols)))


def fixed_tiles(source: Source, dtype: torch.dtype) -> Iterator[tuple[slice, slice, torch.Tensor]]:
    """(rows, columns, x) of every tile, a fused source's x from fixed-shape GEMMs (its shape never
    depends on T): for the top-k ids, which are exact given the logits."""
    walk = _Walk(source, dtype)
    for g0, g1 in walk.groups():
        if source.fused:
            walk.compute(g0, g1)
        for r0, r1, c0, x in walk.views(g0, g1):
            yield slice(r0, r1), slice(c0, c0 + x.size(1)), x


# A compiled kernel's rest and moment sums of real entries x [r, c] at shifts [r] and base-2 scales [r]
# (fp32), the marked columns (local, inside [r, k]) left out, added into int64 [r] outputs (moment: None
# when not wanted) in units of 2^-44; False where it does not take x (the torch tiles' then serve)
RestSums = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                     "torch.Tensor | None"], bool]


def invariant_row_stats(source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                        keep_mask: torch.Tensor | None, scale: float | torch.Tensor,
                        group: dist.ProcessGroup | None, rest_sums: RestSums | None = None) -> RowStats:
    """The full-vocabulary statistics (combined over the ranks) of `stats`' kind — its sums, marked
    ids `cols`/`owned` [T, k], subset (keep mask, or the tail) — in the invariant mode. The sums
    come back in `stats`' dtype from their exact integer values; `rest_sums` (a compiled kernel)
    takes the rest and moment sums where it serves."""
    dtype = stats.shift.dtype
    walk = _Walk(source, dtype)
    device = stats.shift.device
    ints = {name: torch.zeros(source.n_rows, dtype=torch.int64, device=device)
            for name in ("rest", "moment", "sub_sum") if getattr(stats, name) is not None}
    work = _Buffers()
    for g0, g1 in walk.groups():
        if source.fused:
            walk.compute(g0, g1)
        elif tp_size(group) == 1:  # whole rows, no rank to agree with: each chunk's max, then its sums
            for r0, r1, c0, x in walk.views(g0, g1):
                _maxima(stats, slice(r0, r1), x, c0, cols, owned, keep_mask)
                _sums(stats, ints, slice(r0, r1), x, c0, cols, owned, keep_mask, scale, work, rest_sums)
            continue
        for r0, r1, c0, x in walk.views(g0, g1):
            _maxima(stats, slice(r0, r1), x, c0, cols, owned, keep_mask)
        shifts = [stats.shift] + ([stats.sub_shift] if stats.sub_shift is not None else [])
        if tp_size(group) > 1:
            # MAX all-reduce over the tensor-parallel group: the rows' full-vocabulary maxima,
            # known before any exp-sum (so no sum is ever rescaled)
            both = all_reduce_max_(torch.stack([s[g0:g1] for s in shifts]), group)
            for s, value in zip(shifts, both):
                s[g0:g1] = value
        for r0, r1, c0, x in walk.views(g0, g1):
            _sums(stats, ints, slice(r0, r1), x, c0, cols, owned, keep_mask, scale, work, rest_sums)
    if tp_size(group) > 1:
        # SUM all-reduce over the tensor-parallel group: the marked logits from the ranks owning
        # them (0 elsewhere: exact), and every rank's integer sums (exact in any order)
        all_reduce_sum_(stats.marked, group)
        if ints:
            summed = all_reduce_sum_(torch.stack(list(ints.values()), dim=1), group)
            ints = dict(zip(ints, summed.unbind(1)))
    for name, value in ints.items():
        # the moment was summed in powers of 2 (Σ 2^u·u with u·log2 e): ln 2 brings it back
        unit = _FROM_FIXED * (LN2 if name == "moment" else 1.0)
        setattr(stats, name, value.to(torch.float64).mul_(unit).to(dtype))
    return stats


def _subset_view(x: torch.Tensor, marked: torch.Tensor | None, subset: torch.Tensor | None) -> torch.Tensor:
    """x with the columns outside the subset -inf: the kept ids (the marked ones count for the
    max), or the tail (every unmarked column)."""
    if subset is not None:
        return x.masked_fill(~(subset if marked is None else subset | marked), -math.inf)
    return x.masked_fill(marked, -math.inf) if marked is not None else x


def _maxima(stats: RowStats, rows: slice, x: torch.Tensor, c0: int, cols: torch.Tensor, owned: torch.Tensor,
            keep_mask: torch.Tensor | None) -> None:
    """Pass 1 over a tile's real entries x [r, c]: the marked logits and the running maxima (exact
    in any order)."""
    dtype = stats.shift.dtype
    local, inside = column_marks(cols[rows], owned[rows], c0, x.size(1))
    stats.marked[rows] += torch.where(inside, x.gather(1, local).to(dtype), 0.0)
    stats.shift[rows] = torch.maximum(stats.shift[rows], local_row_max(x, dtype))
    if stats.sub_shift is not None:
        marked = marks_mask(x.shape, local, inside)
        subset = keep_mask[rows, c0: c0 + x.size(1)] if keep_mask is not None else None
        stats.sub_shift[rows] = torch.maximum(stats.sub_shift[rows], local_row_max(_subset_view(x, marked, subset),
                                                                                   dtype))


def _sums(stats: RowStats, ints: dict[str, torch.Tensor], part: slice, x: torch.Tensor, c0: int,
          cols: torch.Tensor, owned: torch.Tensor, keep_mask: torch.Tensor | None,
          scale: float | torch.Tensor, work: _Buffers, rest_sums: RestSums | None) -> None:
    """Pass 2 over real entries x [r, c]: their exp-sums at the global shifts, in fixed point.
    Only per-element passes (exp and exp2 one code path for every element) and exact sums."""
    s = scale_rows(scale, part)
    local, inside = column_marks(cols[part], owned[part], c0, x.size(1))
    marked = marks_mask(x.shape, local, inside) if (cols.size(1) > 1 or stats.sub_shift is not None) else None
    if stats.rest is not None and not (rest_sums is not None and rest_sums(
            x, finite_or_zero(stats.shift[part]), torch.as_tensor(base2(s), dtype=torch.float32).reshape(-1),
            local, inside, ints["rest"][part], ints["moment"][part] if stats.moment is not None else None)):
        # u in powers of 2 (u·log2 e) and 2^u, into buffers walked in whole vector steps: exp2 is a
        # third of exp's cost; the moment Σ 2^u·u comes back to natural units (·ln 2) once summed
        n_rows, n_cols = x.shape
        u_all = work.whole_vectors("u", x, stats.shift.dtype)
        u = torch.sub(x, finite_or_zero(stats.shift[part])[:, None], out=u_all[:n_rows, :n_cols]).mul_(base2(s))
        e = torch.exp2(u_all, out=work.whole_vectors("e", x, stats.shift.dtype))[:n_rows, :n_cols]
        doubles = work.get("f", x, torch.float64)
        if marked is None:
            replace_marked(e, local, inside, 0.0)
        else:
            e.masked_fill_(marked, 0.0)
        if stats.moment is not None:  # 2^u·u in [-1/(e·ln 2), 0] = [-0.531, 0]
            ints["moment"][part] += _rounded_sum(torch.mul(e, u.clamp_min_(NEG_FLOOR), out=u), doubles)
        ints["rest"][part] += _rounded_sum(e, doubles)
    if stats.sub_shift is not None:
        assert marked is not None  # built with a subset
        subset = keep_mask[part, c0: c0 + x.size(1)] if keep_mask is not None else None
        u = torch.sub(_subset_view(x, marked, subset), finite_or_zero(stats.sub_shift[part])[:, None]).to(
            stats.shift.dtype)
        if isinstance(s, torch.Tensor) or s != 1.0:
            u.mul_(s)
        ints["sub_sum"][part] += _fixed_sum(u.exp_().masked_fill_(marked, 0.0), work.get("i", x, torch.int64))


class InvariantTiles(Backend):
    """The invariant mode as a backend: forward statistics (global maxima first, fixed-point sums,
    finalize in fixed row blocks) and top-k ids from fixed-shape tiles; the gradients of `base`,
    the backend ``backend=`` chose."""

    name = "invariant"

    def __init__(self, base: Backend) -> None:
        self.base = base

    def available(self, device: torch.device) -> str | None:
        return None

    def row_stats(self, source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                  keep_mask: torch.Tensor | None, scale: float | torch.Tensor) -> RowStats:
        return invariant_row_stats(source, stats, cols, owned, keep_mask, scale, None)

    def combined_stats(self, source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                       keep_mask: torch.Tensor | None, scale: float | torch.Tensor,
                       group: dist.ProcessGroup | None) -> RowStats:
        return invariant_row_stats(source, stats, cols, owned, keep_mask, scale, group)

    def finalize(self, step: Callable[..., T], n_rows: int, *args: Any) -> T:
        return in_row_blocks(step, n_rows, *args)

    def apply_grad(self, source: Source, factors: Any, scale: float | torch.Tensor,
                   keep_mask: torch.Tensor | None, needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
        return self.base.apply_grad(source, factors, scale, keep_mask, needs)

    def topk(self, source: Source, run: RunningTopk, first_id: int) -> RunningTopk:
        return fold_tiles(run, fixed_tiles(source, run.values.dtype), first_id)

    def tie_tiles(self, source: Source, index: torch.Tensor, dtype: torch.dtype) -> Tiles:
        """Fixed-shape tiles: any subset of rows gets the same bits."""
        assert source.hidden is not None  # fused
        return fixed_tiles(Source(source.n_valid, source.chunk_rows, hidden=source.hidden[index],
                                  weight=source.weight), dtype)
