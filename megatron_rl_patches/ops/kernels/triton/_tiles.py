"""Triton building blocks shared by the forward and backward kernels: one logits tile (loaded, or
recomputed as h·Wᵀ with fp32 accumulation), a finiteness test and an accurate expm1.

Kept to plain tl.load / tl.dot / tl.where / tl.exp patterns that both the GPU compiler (triton
3.6, 3.7) and the interpreter (TRITON_INTERPRET=1) accept.

Loop bounds: triton 3.6's interpreter passes every int argument as a 1-element array and turns it
into a Python int with ``int(array)``, which numpy ≥ 2.4 refuses ("only 0-dimensional arrays can
be converted to Python scalars"); 3.7 squeezes first. So no kernel here hands ``range`` a bound
known only at run time: the hidden size is a ``tl.constexpr`` (one compile per model width, and a
trip count the compiler knows), and the column loops, whose bounds depend on the program and T,
are ``while c0 < c_end`` loops (a 1-element array's truth value is still allowed).
"""
from __future__ import annotations

import triton
import triton.language as tl

# _stats.NEG_FLOOR: the finite stand-in for -inf shifted logits in e^u·u (0·(-inf) would be NaN)
NEG_FLOOR: tl.constexpr = tl.constexpr(-1.0e4)


@triton.jit
def finite(v):
    """|v| < inf (False for NaN and ±inf)."""
    return tl.abs(v) < float("inf")


@triton.jit
def row_scales(scale_ptr, scale_value, rows64, row_ok, ROW_SCALE: tl.constexpr, BLOCK_M: tl.constexpr):
    """1/τ of each row of the block: per row from `scale_ptr` (ROW_SCALE), else `scale_value`."""
    if ROW_SCALE:
        s = tl.load(scale_ptr + rows64, mask=row_ok, other=1.0).to(tl.float32)
    else:
        s = tl.zeros((BLOCK_M,), dtype=tl.float32) + scale_value
    return s


@triton.jit
def row_block(first, end, scale_ptr, scale_value, ROW_SCALE: tl.constexpr, BLOCK_M: tl.constexpr):
    """The program's block of rows (grid axis 0), counted from row `first`: their indices as int64,
    which of them lie below `end`, and their 1/τ (`row_scales`)."""
    rows = first + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    rows64 = rows.to(tl.int64)
    return rows64, row_ok, row_scales(scale_ptr, scale_value, rows64, row_ok, ROW_SCALE, BLOCK_M)


@triton.jit
def expm1(y):
    """e^y - 1 without cancellation near 0: a Taylor polynomial (Horner, 9 terms: relative error
    below fp32's epsilon) for |y| < 0.5, else exp(y) - 1 (losing at most ~1.5 bits there).
    libdevice's expm1 exists only on the GPU, not in the interpreter."""
    poly = 1.0 + y / 9.0
    poly = 1.0 + y / 8.0 * poly
    poly = 1.0 + y / 7.0 * poly
    poly = 1.0 + y / 6.0 * poly
    poly = 1.0 + y / 5.0 * poly
    poly = 1.0 + y / 4.0 * poly
    poly = 1.0 + y / 3.0 * poly
    poly = 1.0 + y / 2.0 * poly
    return tl.where(tl.abs(y) < 0.5, y * poly, tl.exp(y) - 1.0)


@triton.jit
def logits_tile(src, weight, rows64, row_ok, cols, col_ok, n_hidden: tl.constexpr, s_src_r, s_src_c, s_w_r, s_w_c,
                FUSED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The fp32 tile x [BLOCK_M, BLOCK_N] of rows `rows64` and columns `cols`: loaded from the
    logits `src`, or (FUSED) ``src[rows] @ weight[cols]ᵀ`` over the hidden size in BLOCK_K
    chunks, fp32 accumulation (ieee for fp32 inputs, as torch's default matmul; bf16/fp16 inputs
    take the tensor cores; DOT_PRECISION is "ieee" for fp32 inputs, the default "tf32" otherwise,
    where it is ignored). Entries outside the valid rows/columns are -inf: they count for
    no max and add e^-inf = 0 to every sum. DOT_FP32: operands upcast before tl.dot (exact for
    bf16/fp16 values; set under the interpreter only, whose tl.dot multiplies bf16's storage bits
    as integers in triton 3.7.1)."""
    ok = row_ok[:, None] & col_ok[None, :]
    cols64 = cols.to(tl.int64)
    if FUSED:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, n_hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < n_hidden
            h = tl.load(src + rows64[:, None] * s_src_r + ks[None, :] * s_src_c,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(weight + cols64[None, :] * s_w_r + ks[:, None] * s_w_c,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if DOT_FP32:
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
        x = acc
    else:
        x = tl.load(src + rows64[:, None] * s_src_r + cols64[None, :] * s_src_c, mask=ok, other=0.0).to(tl.float32)
    return tl.where(ok, x, float("-inf"))


@triton.jit
def marked_columns(x, marks, out_marked, out_row, rows64, row_ok, cols, col_ok, K: tl.constexpr,
                   STORE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's marked columns ([BLOCK_M, BLOCK_N] bool; `marks` [n_rows, K] int32 local
    columns, -1 elsewhere); STORE: each mark's logit in the tile stored to out_marked[out_row, k]."""
    marked = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int1)
    for kk in range(K):
        mark = tl.load(marks + rows64 * K + kk, mask=row_ok, other=-1)
        hit = (cols[None, :] == mark[:, None]) & col_ok[None, :]
        marked = marked | hit
        if STORE:
            found = tl.max(hit.to(tl.int32), axis=1) > 0
            tl.store(out_marked + out_row * K + kk, tl.sum(tl.where(hit, x, 0.0), axis=1), mask=row_ok & found)
    return marked


@triton.jit
def subset_logits(x, marked, keep, rows64, row_ok, cols, col_ok, s_keep_r, s_keep_c, HAS_KEEP: tl.constexpr):
    """x on the subset, -inf elsewhere: the kept ids (whose max counts the marked ones too; `keep`
    int8), or without HAS_KEEP the tail (every unmarked column)."""
    if HAS_KEEP:
        kept = tl.load(keep + rows64[:, None] * s_keep_r + cols[None, :].to(tl.int64) * s_keep_c,
                       mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
        inside = kept | marked
    else:
        inside = marked == 0
    return tl.where(inside, x, float("-inf"))
