"""The invariant mode's two passes as one Triton kernel (``SUMS`` picks the pass), the means of
:mod:`megatron_rl_patches.ops.kernels.invariant_tiles` inside the kernel:

- pass 1 (``SUMS=False``): each row's maxima (its full max, NaN as +inf; the subset's) and the
  marked ids' logits over the program's columns: exact in any order or tiling;
- pass 2 (``SUMS=True``): at the rows' global shifts (known before it: the host's MAX over the
  splits and the ranks), every e^u ≤ 1 and e^u·u truncated to 64-bit fixed point (units of
  2^-FIXED_BITS, ``to_fixed`` = 2^FIXED_BITS) and summed as integers per program.

Grid: (row blocks, vocabulary splits); each program writes its split's row values, which the host
combines exactly (max, or int64 sum). An element's x is computed alone — loaded, or one
``tl.dot`` of fixed BLOCK_K chunks over the hidden size, fp32 accumulation, in a tile of one
shape whatever T, the split or the shard — and every other step is per element or exact, so a
row's outputs depend on that row only.
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
def _no_nan_max(x):
    """Per-row max with NaN as +inf (a MAX all-reduce then keeps it; the op reports the row)."""
    return tl.max(tl.where(x != x, float("inf"), x), axis=1)


@triton.jit
def _fixed_sum(v, to_fixed):
    """Σ over the columns of v in [-1, 1] as int64 units of 1/to_fixed, each entry truncated."""
    return tl.sum((v * to_fixed).to(tl.int64), axis=1)


@triton.jit
def invariant_tile_kernel(
    src, weight, keep, marks, scale_ptr, shift_ptr, sub_shift_ptr,
    out_shift, out_sub_shift, out_marked, out_rest, out_moment, out_sub_sum,
    n_rows, n_valid, n_hidden: tl.constexpr, cols_per_split, scale_value, to_fixed,
    s_src_r, s_src_c, s_w_r, s_w_c, s_keep_r, s_keep_c,
    SUMS: tl.constexpr, K: tl.constexpr, FUSED: tl.constexpr, ROW_SCALE: tl.constexpr, HAS_REST: tl.constexpr,
    HAS_MOMENT: tl.constexpr, HAS_SUB: tl.constexpr, HAS_KEEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Outputs [splits, n_rows] (out_marked [splits, n_rows, K], zero-filled by the host; the int64
    sums in pass 2). `shift_ptr` / `sub_shift_ptr` [n_rows]: the global shifts pass 2 reads.
    `marks` [n_rows, K] int32 local columns, -1 where another rank owns the id; `keep` int8."""
    pid_s = tl.program_id(1)
    rows64, row_ok, s = row_block(0, n_rows, scale_ptr, scale_value, ROW_SCALE, BLOCK_M)
    out_row = pid_s.to(tl.int64) * n_rows + rows64
    shift = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    sub_shift = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    if SUMS:  # the global shifts, non-finite ones as 0 (finite_or_zero)
        shift = tl.load(shift_ptr + rows64, mask=row_ok, other=0.0)
        shift = tl.where(finite(shift), shift, 0.0)
        if HAS_SUB:
            sub_shift = tl.load(sub_shift_ptr + rows64, mask=row_ok, other=0.0)
            sub_shift = tl.where(finite(sub_shift), sub_shift, 0.0)
    rest = tl.zeros((BLOCK_M,), dtype=tl.int64)
    moment = tl.zeros((BLOCK_M,), dtype=tl.int64)
    sub_sum = tl.zeros((BLOCK_M,), dtype=tl.int64)
    c_begin = pid_s * cols_per_split
    c_end = tl.minimum(c_begin + cols_per_split, n_valid)
    c0 = c_begin
    while c0 < c_end:  # run-time bounds: see _tiles' docstring
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < c_end
        x = logits_tile(src, weight, rows64, row_ok, cols, col_ok, n_hidden, s_src_r, s_src_c, s_w_r, s_w_c,
                        FUSED, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, DOT_PRECISION)
        marked = marked_columns(x, marks, out_marked, out_row, rows64, row_ok, cols, col_ok, K, not SUMS, BLOCK_M,
                                BLOCK_N)
        if HAS_SUB:
            sub_x = subset_logits(x, marked, keep, rows64, row_ok, cols, col_ok, s_keep_r, s_keep_c, HAS_KEEP)
        if SUMS:
            if HAS_REST:
                u = (x - shift[:, None]) * s[:, None]
                e = tl.where(marked, 0.0, tl.exp(u))
                if HAS_MOMENT:
                    moment += _fixed_sum(e * tl.maximum(u, NEG_FLOOR), to_fixed)
                rest += _fixed_sum(e, to_fixed)
            if HAS_SUB:
                sub_e = tl.where(marked, 0.0, tl.exp((sub_x - sub_shift[:, None]) * s[:, None]))
                sub_sum += _fixed_sum(sub_e, to_fixed)
        else:
            shift = tl.maximum(shift, _no_nan_max(x))
            if HAS_SUB:
                sub_shift = tl.maximum(sub_shift, _no_nan_max(sub_x))
        c0 += BLOCK_N
    if SUMS:
        if HAS_REST:
            tl.store(out_rest + out_row, rest, mask=row_ok)
        if HAS_MOMENT:
            tl.store(out_moment + out_row, moment, mask=row_ok)
        if HAS_SUB:
            tl.store(out_sub_sum + out_row, sub_sum, mask=row_ok)
    else:
        tl.store(out_shift + out_row, shift, mask=row_ok)
        if HAS_SUB:
            tl.store(out_sub_shift + out_row, sub_shift, mask=row_ok)
