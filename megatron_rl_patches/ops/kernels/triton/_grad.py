"""The backward kernel: dL/dx of recomputed logits tiles by
:func:`~megatron_rl_patches.ops._stats.tile_grad`'s formula (:class:`~megatron_rl_patches.ops._stats.GradFactors`),
formed in registers and stored once.

Grid: (row blocks, column blocks), one tile per program, no reduction across programs. For a
logits source the output is the logits' gradient (possibly the logits' own storage: each program
reads its tile before writing it); for a hidden-state source it is dz of a block of columns, which
the host turns into dW[cols] = dzᵀ·h and dh += dz·W[cols] with two matmuls (see backend.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from megatron_rl_patches.ops.kernels.triton._tiles import NEG_FLOOR, expm1, logits_tile, row_block


@triton.jit
def grad_tile_kernel(
    src, weight, keep, marks, scale_ptr, out,
    f_shift, f_log_sum, f_alpha, f_beta, f_sub_shift, f_log_sub, f_gamma, f_mark_alpha, f_eta, f_delta,
    row_begin, row_end, col_begin, col_end, n_hidden: tl.constexpr, scale_value,
    s_src_r, s_src_c, s_w_r, s_w_c, s_keep_r, s_keep_c, s_out_r, s_out_c,
    K: tl.constexpr, FUSED: tl.constexpr, ROW_SCALE: tl.constexpr, HAS_ALPHA: tl.constexpr, HAS_BETA: tl.constexpr,
    HAS_SUB: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_MARK_ALPHA: tl.constexpr,
    HAS_ETA: tl.constexpr, HAS_DELTA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Rows [row_begin, row_end) and columns [col_begin, col_end) of the source; out[r - row_begin,
    c - col_begin]. Factors are per row ([T]) or per mark ([T, K] row-major, marks as local
    columns of the whole shard); absent ones are flagged off (their pointers unused)."""
    pid_n = tl.program_id(1)
    rows64, row_ok, s = row_block(row_begin, row_end, scale_ptr, scale_value, ROW_SCALE, BLOCK_M)
    cols = col_begin + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < col_end
    x = logits_tile(src, weight, rows64, row_ok, cols, col_ok, n_hidden, s_src_r, s_src_c, s_w_r, s_w_c,
                    FUSED, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, DOT_PRECISION)
    dz = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # e^(u - L)·(alpha + beta·max(u, NEG_FLOOR)), u = (x - shift)·s
    u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    beta = tl.zeros((BLOCK_M,), dtype=tl.float32)
    shift = tl.zeros((BLOCK_M,), dtype=tl.float32)
    log_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if HAS_ALPHA:
        shift = tl.load(f_shift + rows64, mask=row_ok, other=0.0)
        log_sum = tl.load(f_log_sum + rows64, mask=row_ok, other=0.0)
        alpha = tl.load(f_alpha + rows64, mask=row_ok, other=0.0)
        u = (x - shift[:, None]) * s[:, None]
        p = tl.exp(u - log_sum[:, None])
        if HAS_BETA:
            beta = tl.load(f_beta + rows64, mask=row_ok, other=0.0)
            dz = p * (alpha[:, None] + beta[:, None] * tl.maximum(u, NEG_FLOOR))
        else:
            dz = p * alpha[:, None]
    # the eta term's shift and log-sum: the subset's, or the full ones without a subset
    sub_shift = shift
    log_sub = log_sum
    if HAS_SUB:
        sub_shift = tl.load(f_sub_shift + rows64, mask=row_ok, other=0.0)
        log_sub = tl.load(f_log_sub + rows64, mask=row_ok, other=0.0)
    if HAS_GAMMA:
        # gamma·[j in S]·e^(u' - L'), u' = (x - sub_shift)·s
        gamma = tl.load(f_gamma + rows64, mask=row_ok, other=0.0)
        q = tl.exp((x - sub_shift[:, None]) * s[:, None] - log_sub[:, None])
        if HAS_KEEP:
            kept = tl.load(keep + rows64[:, None] * s_keep_r + cols[None, :].to(tl.int64) * s_keep_c,
                           mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
            q = tl.where(kept, q, 0.0)
        dz += gamma[:, None] * q
    # marked columns: their exact value replaces the formula's (duplicate marks add up)
    marked = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int1)
    marked_value = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(K):
        mark = tl.load(marks + rows64 * K + kk, mask=row_ok, other=-1)
        hit = (cols[None, :] == mark[:, None]) & col_ok[None, :]
        marked = marked | hit
        value = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HAS_MARK_ALPHA:
            mark_alpha = tl.load(f_mark_alpha + rows64 * K + kk, mask=row_ok, other=0.0)
            value = p * (mark_alpha[:, None] + beta[:, None] * tl.maximum(u, NEG_FLOOR))
        if HAS_ETA:
            eta = tl.load(f_eta + rows64 * K + kk, mask=row_ok, other=0.0)
            # -expm1 keeps 1 - p exact as p -> 1
            value -= eta[:, None] * expm1((x - sub_shift[:, None]) * s[:, None] - log_sub[:, None])
        if HAS_DELTA:
            value += tl.load(f_delta + rows64 * K + kk, mask=row_ok, other=0.0)[:, None]
        marked_value += tl.where(hit, value, 0.0)
    dz = tl.where(marked, marked_value, dz)
    out_rows = rows64 - row_begin
    out_cols = (cols - col_begin).to(tl.int64)
    tl.store(out + out_rows[:, None] * s_out_r + out_cols[None, :] * s_out_c,
             dz.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
