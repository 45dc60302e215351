"""The top-k id kernel: for each row block and vocabulary tile, the tile's k largest logits and
their ids, chosen exactly by (value descending, id ascending): k rounds of a row max and the lowest
column holding it. The host merges the tiles' candidates with the same order
(:func:`megatron_rl_patches.ops.topk_select.best_of`), so no tie is ever left ambiguous.

Grid: (row blocks, vocabulary tiles). Writes values [n_rows, tiles·K] (fp32; -inf and id
`sentinel` where a tile has fewer than K valid columns), ids [n_rows, tiles·K] and each tile's max
[tiles, n_rows] (NaN as +inf, for the bad-row check).
"""
from __future__ import annotations

import triton
import triton.language as tl

from megatron_rl_patches.ops.kernels.triton._tiles import logits_tile


@triton.jit
def topk_tile_kernel(
    src, weight, out_values, out_ids, out_max,
    n_rows, n_valid, n_hidden: tl.constexpr, first_id, sentinel,
    s_src_r, s_src_c, s_w_r, s_w_c,
    K: tl.constexpr, FUSED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_tiles = tl.num_programs(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_valid
    x = logits_tile(src, weight, rows64, row_ok, cols, col_ok, n_hidden, s_src_r, s_src_c, s_w_r, s_w_c,
                    FUSED, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, DOT_PRECISION)
    x = tl.where(x != x, float("inf"), x)  # NaN ranks first and counts as +inf: a bad row, raised by the op
    tl.store(out_max + pid_n.to(tl.int64) * n_rows + rows64, tl.max(x, axis=1), mask=row_ok)
    free = row_ok[:, None] & col_ok[None, :]  # columns not chosen yet
    base = rows64 * (n_tiles * K) + pid_n * K
    for kk in tl.static_range(K):
        best = tl.max(tl.where(free, x, float("-inf")), axis=1)
        at = tl.min(tl.where(free & (x == best[:, None]), cols[None, :], n_valid), axis=1)
        found = at < n_valid
        tl.store(out_values + base + kk, tl.where(found, best, float("-inf")), mask=row_ok)
        tl.store(out_ids + base + kk, tl.where(found, at.to(tl.int64) + first_id, sentinel), mask=row_ok)
        free = free & (cols[None, :] != at[:, None])
