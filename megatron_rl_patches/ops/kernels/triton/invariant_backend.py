"""The invariant mode on the Triton backend: :class:`InvariantTriton`, the invariant tiles whose
forward statistics come from :mod:`._invariant`'s kernel (pass 1, the MAX all-reduce of the
rows' shifts, pass 2 in 64-bit fixed point, one SUM all-reduce of the integers: exact, so the
split never shows). Each row's bits depend on that row alone, as the torch tiles'; the exponent
and the fused head's GEMM are Triton's, so its values are within 1e-6 of the torch tiles' (fp32),
not their bits. The backward is the Triton kernels' (exact from the saved statistics, as every
backend's gradient in the invariant mode); the top-k ids stay the torch invariant tiles'.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import triton

from megatron_rl_patches.ops._dist import all_reduce_max_, all_reduce_sum_, tp_size
from megatron_rl_patches.ops._stats import RowStats
from megatron_rl_patches.ops.kernels.invariant_tiles import FIXED_BITS, InvariantTiles
from megatron_rl_patches.ops.kernels.sources import Source
from megatron_rl_patches.ops.kernels.triton._invariant import invariant_tile_kernel
from megatron_rl_patches.ops.kernels.triton.launch import Blocks, blocks, column_splits, src_args, tile_args

SUM_NAMES = ("rest", "moment", "sub_sum")


class InvariantTriton(InvariantTiles):
    """The invariant tiles with the forward statistics from the Triton kernel (fp64 stays on the
    torch invariant tiles: tl.dot has no fp64 path on every GPU); the gradients of `base`."""

    def row_stats(self, source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                  keep_mask: torch.Tensor | None, scale: float | torch.Tensor) -> RowStats:
        return self.combined_stats(source, stats, cols, owned, keep_mask, scale, None)

    def combined_stats(self, source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                       keep_mask: torch.Tensor | None, scale: float | torch.Tensor,
                       group: dist.ProcessGroup | None) -> RowStats:
        if stats.shift.dtype == torch.float64 or source.first.dtype == torch.float64:
            return super().combined_stats(source, stats, cols, owned, keep_mask, scale, group)
        return kernel_row_stats(source, stats, cols, owned, keep_mask, scale, group)


def kernel_row_stats(source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                     keep_mask: torch.Tensor | None, scale: float | torch.Tensor,
                     group: dist.ProcessGroup | None) -> RowStats:
    """`stats` (empty, as the contract hands it) filled with the full-vocabulary statistics over
    the tensor-parallel `group` (None: this shard is the vocabulary), the sums from their exact
    integer values."""
    device = source.first.device
    n_rows, n_valid, k = source.n_rows, source.n_valid, cols.size(1)
    wanted = [name for name in SUM_NAMES if getattr(stats, name) is not None]
    b = blocks(device, source.fused)
    splits, cols_per_split = column_splits(n_rows, n_valid, b, device) if n_rows and n_valid else (1, b.n)
    shifts = torch.full((2, splits, n_rows), -torch.inf, dtype=torch.float32, device=device)
    marked = torch.zeros(splits, n_rows, k, dtype=torch.float32, device=device)
    ints = torch.zeros(len(SUM_NAMES), splits, n_rows, dtype=torch.int64, device=device)
    has_sub = stats.sub_shift is not None
    launch = _Launch(source, cols, owned, keep_mask, scale, stats, (splits, cols_per_split), b)
    if n_rows and n_valid:
        launch(shifts, marked, ints, sums=False)
    global_shifts = shifts.amax(1)[: 1 + has_sub]  # over the splits: exact
    if tp_size(group) > 1:
        # MAX all-reduce over the tensor-parallel group: the rows' full-vocabulary maxima, known
        # before any exp-sum (so no sum is ever rescaled)
        all_reduce_max_(global_shifts, group)
    if n_rows and n_valid and wanted:
        launch(global_shifts, marked, ints, sums=True)
    row_marked = marked.sum(0)  # one split holds each mark, the others 0: exact
    row_ints = ints.sum(1)  # integers: exact in any order
    if tp_size(group) > 1:
        # SUM all-reduce over the tensor-parallel group: the marked logits from the ranks owning
        # them (0 elsewhere: exact), and every rank's integer sums (exact in any order)
        all_reduce_sum_(row_marked, group)
        if wanted:
            all_reduce_sum_(row_ints, group)
    stats.shift.copy_(global_shifts[0])
    stats.marked.copy_(row_marked)
    if stats.sub_shift is not None:
        stats.sub_shift.copy_(global_shifts[1])
    for index, name in enumerate(SUM_NAMES):
        if name in wanted:
            getattr(stats, name).copy_(row_ints[index].to(torch.float64).mul_(2.0 ** -FIXED_BITS))
    return stats


class _Launch:
    """The kernel's arguments for one call, launched per pass."""

    def __init__(self, source: Source, cols: torch.Tensor, owned: torch.Tensor, keep_mask: torch.Tensor | None,
                 scale: float | torch.Tensor, stats: RowStats, split: tuple[int, int], b: Blocks) -> None:
        self.source, self.stats, self.split, self.b = source, stats, split, b
        self.k = cols.size(1)
        self.args = tile_args(keep_mask, scale, torch.float32, (cols, owned) if self.k else None)

    def __call__(self, shifts: torch.Tensor, marked: torch.Tensor, ints: torch.Tensor, *, sums: bool) -> None:
        source, stats, b, a = self.source, self.stats, self.b, self.args
        splits, cols_per_split = self.split
        dummy = marked
        src, weight, n_hidden, *strides = src_args(source)
        # pass 1 writes every split's maxima ([2, splits, T]); pass 2 reads the global ones ([≤2, T])
        shift_out, sub_out = (shifts[0], shifts[1]) if not sums else (dummy, dummy)
        shift_in = shifts[0].contiguous() if sums else dummy
        sub_in = shifts[1].contiguous() if sums and stats.sub_shift is not None else dummy
        invariant_tile_kernel[(triton.cdiv(source.n_rows, b.m), splits)](
            src, weight, *a.pointers(dummy),
            shift_in, sub_in, shift_out, sub_out, marked, ints[0], ints[1], ints[2],
            source.n_rows, source.n_valid, n_hidden, cols_per_split, a.scale_value, float(2 ** FIXED_BITS),
            *strides, *a.keep_strides,
            SUMS=sums, K=self.k, FUSED=source.fused, ROW_SCALE=a.scale is not None,
            HAS_REST=stats.rest is not None, HAS_MOMENT=stats.moment is not None,
            HAS_SUB=stats.sub_shift is not None, HAS_KEEP=a.keep is not None,
            **b.launch(source.first.dtype),
        )
