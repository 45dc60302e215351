"""The forward kernel: per-row softmax statistics (:class:`~megatron_rl_patches.ops._stats.RowStats`)
of a block of rows over one split of the vocabulary shard, folded online tile by tile exactly as
:func:`~megatron_rl_patches.ops._stats.fold_tile` folds them.

Grid: (row blocks, vocabulary splits). Each program writes its split's partial statistics; the
host merges the splits (the same max-and-rescale step as the cross-rank combine). Splitting the
vocabulary gives the GPU enough programs when T is small; the merge costs O(splits·T).
"""
from __future__ import annotations

import triton
import triton.language as tl

from megatron_rl_patches.ops.kernels.triton._tiles import (
    NEG_FLOOR,
    finite,
    logits_tile,
    marked_columns,
    row_block,
    subset_logits,
)


@triton.jit
def row_stats_kernel(
    src, weight, keep, marks, scale_ptr,
    out_shift, out_rest, out_moment, out_sub_shift, out_sub_sum, out_marked,
    n_rows, n_valid, n_hidden: tl.constexpr, cols_per_split, scale_value,
    s_src_r, s_src_c, s_w_r, s_w_c, s_keep_r, s_keep_c,
    K: tl.constexpr, FUSED: tl.constexpr, ROW_SCALE: tl.constexpr, HAS_REST: tl.constexpr,
    HAS_MOMENT: tl.constexpr, HAS_SUB: tl.constexpr, HAS_KEEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Outputs are [splits, n_rows] (out_marked [splits, n_rows, K], zero-filled by the host: a
    mark is stored only by the split holding its column). `marks` [n_rows, K] int32: the marked
    ids' local columns, -1 where another rank owns them. `keep` [n_rows, ≥ n_valid] int8."""
    pid_s = tl.program_id(1)
    rows64, row_ok, s = row_block(0, n_rows, scale_ptr, scale_value, ROW_SCALE, BLOCK_M)
    shift = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    rest = tl.zeros((BLOCK_M,), dtype=tl.float32)
    moment = tl.zeros((BLOCK_M,), dtype=tl.float32)
    sub_shift = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    sub_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    out_row = pid_s.to(tl.int64) * n_rows + rows64
    c_begin = pid_s * cols_per_split
    c_end = tl.minimum(c_begin + cols_per_split, n_valid)
    c0 = c_begin
    while c0 < c_end:  # run-time bounds: see _tiles' docstring
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < c_end
        x = logits_tile(src, weight, rows64, row_ok, cols, col_ok, n_hidden, s_src_r, s_src_c, s_w_r, s_w_c,
                        FUSED, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, DOT_PRECISION)
        # the marked columns (k ids per row, k small): their logits stored, and they leave every sum
        marked = marked_columns(x, marks, out_marked, out_row, rows64, row_ok, cols, col_ok, K, True, BLOCK_M,
                                BLOCK_N)
        # NaN counts as +inf in the max (a bad row the op reports; a MAX all-reduce keeps it)
        tile_max = tl.max(tl.where(x != x, float("inf"), x), axis=1)
        new_shift = tl.maximum(shift, tile_max)
        if HAS_REST:
            safe = tl.where(finite(new_shift), new_shift, 0.0)
            started = finite(shift)
            # floored as _stats.moved floors it: at a tiny τ the product overflows, and 0·(-inf) is NaN
            log_factor = tl.where(started, tl.maximum((shift - safe) * s, NEG_FLOOR), 0.0)
            factor = tl.where(started, tl.exp(log_factor), 0.0)
            u = (x - safe[:, None]) * s[:, None]
            e = tl.where(marked, 0.0, tl.exp(u))
            if HAS_MOMENT:
                moment = factor * (moment + rest * log_factor) + tl.sum(e * tl.maximum(u, NEG_FLOOR), axis=1)
            rest = rest * factor + tl.sum(e, axis=1)
        shift = new_shift
        if HAS_SUB:
            # the subset: kept ids (whose max counts the marked target), or the tail (unmarked columns)
            sub_x = subset_logits(x, marked, keep, rows64, row_ok, cols, col_ok, s_keep_r, s_keep_c, HAS_KEEP)
            new_sub = tl.maximum(sub_shift, tl.max(tl.where(sub_x != sub_x, float("inf"), sub_x), axis=1))
            safe_sub = tl.where(finite(new_sub), new_sub, 0.0)
            sub_factor = tl.where(finite(sub_shift), tl.exp((sub_shift - safe_sub) * s), 0.0)
            sub_e = tl.where(marked, 0.0, tl.exp((sub_x - safe_sub[:, None]) * s[:, None]))
            sub_sum = sub_sum * sub_factor + tl.sum(sub_e, axis=1)
            sub_shift = new_sub
        c0 += BLOCK_N
    tl.store(out_shift + out_row, shift, mask=row_ok)
    if HAS_REST:
        tl.store(out_rest + out_row, rest, mask=row_ok)
    if HAS_MOMENT:
        tl.store(out_moment + out_row, moment, mask=row_ok)
    if HAS_SUB:
        tl.store(out_sub_shift + out_row, sub_shift, mask=row_ok)
        tl.store(out_sub_sum + out_row, sub_sum, mask=row_ok)
