"""The full-vocabulary divergence kernels of :func:`~megatron_rl_patches.ops.divergence.lm_head_divergence`
against one teacher: pass 2 (the value and G = Σ g per row) and the backward's dz = (g − p·G)·r, with
both models' logits tiles recomputed in registers (x = h·Wᵀ, ``tl.dot``) and never stored.

The per-entry terms and gradient terms are the table's (:data:`megatron_rl_patches.ops._divergences.TABLE`):
:func:`entry_terms` is its rows written in Triton, one branch per row, tested row by row against the
torch route. a = (x_s − m_s)·s − L_s and b = (x_t − m_t)·s − L_t come from the normalizers pass 1
folded. Entries outside the valid rows and columns, or outside keep_mask, have no term and no
gradient (as the -inf-safe primitives give on the torch route).

Pass 2's grid: (row blocks, vocabulary splits), each program summing its split's columns into
[splits, T, 2] partials the host adds (fixed order: deterministic). Backward's grid: (row blocks,
column blocks) of one block of columns; the host turns dz into dW and dh with two matmuls, as the
log-prob backward does (backend.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from megatron_rl_patches.ops.kernels.triton._tiles import logits_tile, row_block

# The divergence table's rows entry_terms computes, one branch each; a row's DIV code is its place
# here. A row not listed is not served (serves_divergence): the torch tiles evaluate it.
KERNEL_DIVERGENCES = ("forward_kl", "reverse_kl", "mixed_kl", "jsd", "skew_forward_kl", "skew_reverse_kl", "tv")
FORWARD_KL: tl.constexpr = tl.constexpr(KERNEL_DIVERGENCES.index("forward_kl"))
REVERSE_KL: tl.constexpr = tl.constexpr(KERNEL_DIVERGENCES.index("reverse_kl"))
MIXED_KL: tl.constexpr = tl.constexpr(KERNEL_DIVERGENCES.index("mixed_kl"))
JSD: tl.constexpr = tl.constexpr(KERNEL_DIVERGENCES.index("jsd"))
SKEW_FORWARD_KL: tl.constexpr = tl.constexpr(KERNEL_DIVERGENCES.index("skew_forward_kl"))
SKEW_REVERSE_KL: tl.constexpr = tl.constexpr(KERNEL_DIVERGENCES.index("skew_reverse_kl"))
TV: tl.constexpr = tl.constexpr(KERNEL_DIVERGENCES.index("tv"))


@triton.jit
def log1p(y):
    """log(1 + y) for y ≥ 0 without losing small y (libdevice's log1p is GPU-only): a 4-term
    series below 1e-3 (relative error < 1e-12), else log(1 + y)."""
    series = y * (1.0 - y * (0.5 - y * (1.0 / 3.0 - y * 0.25)))
    return tl.where(y < 1.0e-3, series, tl.log(1.0 + y))


@triton.jit
def log_mix(lx, ly, log_w, log_1mw):
    """log(w·e^lx + (1 − w)·e^ly) for finite lx, ly (the table's `mix`, log w and log(1 − w) given)."""
    u = lx + log_w
    v = ly + log_1mw
    top = tl.maximum(u, v)
    return top + log1p(tl.exp(-tl.abs(u - v)))


@triton.jit
def entry_terms(a, b, w, log_w, log_1mw, DIV: tl.constexpr):
    """(the divergence's term per entry, its gradient term g = ∂D/∂a up to a multiple of p, p) for
    finite a = log p_s and b = log q: the table row DIV, parameter w (β or α)."""
    p = tl.exp(a)
    q = tl.exp(b)
    if DIV == FORWARD_KL:
        term = q * (b - a)
        g = p - q
    elif DIV == REVERSE_KL:
        term = p * (a - b)
        g = term
    elif DIV == MIXED_KL:
        rev = p * (a - b)
        term = (1.0 - w) * (q * (b - a)) + w * rev
        g = (1.0 - w) * (p - q) + w * rev
    elif DIV == JSD:  # M = β·q + (1 − β)·p
        lm = log_mix(b, a, log_w, log_1mw)
        k = p * (a - lm)
        term = w * (q * (b - lm)) + (1.0 - w) * k
        g = (1.0 - w) * k
    elif DIV == SKEW_FORWARD_KL:  # M = α·q + (1 − α)·p
        lm = log_mix(b, a, log_w, log_1mw)
        term = q * (b - lm)
        g = (w - 1.0) * tl.exp(b + a - lm)
    elif DIV == SKEW_REVERSE_KL:  # M = α·p + (1 − α)·q
        lm = log_mix(a, b, log_w, log_1mw)
        term = p * (a - lm)
        g = term + (1.0 - w) * tl.exp(a + b - lm)
    elif DIV == TV:
        d = p - q
        term = 0.5 * tl.abs(d)
        g = 0.5 * p * tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    else:
        tl.static_assert(False, "entry_terms: no branch for this DIV code (see KERNEL_DIVERGENCES)")
    return term, g, p


@triton.jit
def _log_probs(hidden, weight, norm, rows64, row_ok, cols, col_ok, s, n_hidden: tl.constexpr, s_h_r, s_h_c, s_w_r,
               s_w_c, n_rows, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One model's log-probs (x − m)·s − L of a tile; `norm` [2, n_rows]: the shifts, then log S."""
    x = logits_tile(hidden, weight, rows64, row_ok, cols, col_ok, n_hidden, s_h_r, s_h_c, s_w_r, s_w_c,
                    True, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, DOT_PRECISION)
    shift = tl.load(norm + rows64, mask=row_ok, other=0.0)
    log_sum = tl.load(norm + n_rows + rows64, mask=row_ok, other=0.0)
    return (x - shift[:, None]) * s[:, None] - log_sum[:, None]


@triton.jit
def divergence_tile_kernel(
    h_s, w_s, h_t, w_t, norm_s, norm_t, keep, scale_ptr, constant, row_factor, out,
    n_rows, col_begin, col_end, cols_per_split, n_hidden_s: tl.constexpr, n_hidden_t: tl.constexpr, scale_value, w,
    log_w, log_1mw,
    s_hs_r, s_hs_c, s_ws_r, s_ws_c, s_ht_r, s_ht_c, s_wt_r, s_wt_c, s_keep_r, s_keep_c, s_out_r, s_out_c,
    DIV: tl.constexpr, GRAD: tl.constexpr, HAS_CONSTANT: tl.constexpr, ROW_SCALE: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Not GRAD: program (m, j) sums columns [col_begin + j·cols_per_split, +cols_per_split) of
    its rows into out[j, r, 0] (the value) and out[j, r, 1] (G = Σ g). GRAD: program (m, j)
    writes dz = (g − p·G)·row_factor of its [BLOCK_M, BLOCK_N] tile of columns [col_begin,
    col_end) to out[r, c − col_begin] (G = `constant` [T] when HAS_CONSTANT, else 0)."""
    pid_n = tl.program_id(1)
    rows64, row_ok, s = row_block(0, n_rows, scale_ptr, scale_value, ROW_SCALE, BLOCK_M)
    if GRAD:
        c_begin = col_begin + pid_n * BLOCK_N
        c_end = tl.minimum(c_begin + BLOCK_N, col_end)
    else:
        c_begin = col_begin + pid_n * cols_per_split
        c_end = tl.minimum(c_begin + cols_per_split, col_end)
    value = tl.zeros((BLOCK_M,), dtype=tl.float32)
    g_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    c0 = c_begin
    while c0 < c_end:  # run-time bounds: see _tiles' docstring
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < c_end
        ok = row_ok[:, None] & col_ok[None, :]
        if HAS_KEEP:
            kept = tl.load(keep + rows64[:, None] * s_keep_r + cols[None, :].to(tl.int64) * s_keep_c,
                           mask=ok, other=0) != 0
            ok = ok & kept
        a = _log_probs(h_s, w_s, norm_s, rows64, row_ok, cols, col_ok, s, n_hidden_s, s_hs_r, s_hs_c, s_ws_r,
                       s_ws_c, n_rows, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, DOT_PRECISION)
        b = _log_probs(h_t, w_t, norm_t, rows64, row_ok, cols, col_ok, s, n_hidden_t, s_ht_r, s_ht_c, s_wt_r,
                       s_wt_c, n_rows, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, DOT_PRECISION)
        # finite stand-ins outside: their terms are dropped below, and no NaN is ever formed
        term, g, p = entry_terms(tl.where(ok, a, 0.0), tl.where(ok, b, 0.0), w, log_w, log_1mw, DIV)
        if GRAD:
            if HAS_CONSTANT:
                G = tl.load(constant + rows64, mask=row_ok, other=0.0)
                g = g - p * G[:, None]
            r = tl.load(row_factor + rows64, mask=row_ok, other=0.0)
            dz = tl.where(ok, g * r[:, None], 0.0)
            out_cols = (cols - col_begin).to(tl.int64)
            tl.store(out + rows64[:, None] * s_out_r + out_cols[None, :] * s_out_c, dz.to(out.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])
        else:
            value += tl.sum(tl.where(ok, term, 0.0), axis=1)
            g_sum += tl.sum(tl.where(ok, g, 0.0), axis=1)
        c0 += BLOCK_N
    if not GRAD:
        out_row = (pid_n.to(tl.int64) * n_rows + rows64) * 2
        tl.store(out + out_row, value, mask=row_ok)
        tl.store(out + out_row + 1, g_sum, mask=row_ok)
