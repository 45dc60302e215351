"""Per-token log-prob and entropy over vocab-parallel ``[T, V_local]`` logits at the memory floor.

One autograd Function walks the rows in chunks. Between forward and backward it keeps only the
input logits (through ``save_for_backward``) and a few numbers per token; backward recomputes the
softmax chunk by chunk, and with ``inplace_backward=True`` writes the gradient into the logits'
own storage. With tensor parallelism the forward needs one MAX and one SUM all-reduce of O(rows)
values per chunk and the backward none.

The streaming pieces (:func:`default_chunk_rows`, :func:`valid_local_columns`,
:func:`row_chunks`, :func:`local_row_max`, :func:`shifted_rows`, :func:`vocab_logsumexp`) are
shared with the top-k ops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megatron_rl_patches.ops._dist import all_reduce_max_, all_reduce_sum_, tp_size, vocab_start

__all__ = [
    "log_probs_and_entropy",
    "vocab_logsumexp",
    "default_chunk_rows",
    "valid_local_columns",
    "row_chunks",
    "local_row_max",
    "shifted_rows",
    "row_scale",
    "compute_dtype",
    "CPU_CHUNK_BYTES",
    "CUDA_CHUNK_BYTES",
]

# Bytes of one [rows, V_local] working buffer of the compute dtype; a chunk keeps two such
# buffers (plus per-row vectors) alive. CPU: 2 MiB per buffer (16 rows at V = 32000) keeps the
# ~4 MiB working set in L2/L3 while each chunk's dozen small ops stay cheap next to its
# elementwise passes (2-core Xeon, 1 thread, V = 32000: 2-8 MiB alike, 0.25-0.5 MiB up to 2x
# slower from per-chunk overhead, 16 MiB slower again). GPU: larger chunks keep kernel launches
# few; the transient memory stays far below one copy of the logits.
CPU_CHUNK_BYTES = 2 << 20
CUDA_CHUNK_BYTES = 128 << 20

# Kept ids (keep_mask) reuse the full-vocab exp(u) while their max lies within this distance
# (scaled units) of the full max. Shifted logits are rounded at their magnitude g, costing ~g·eps
# in the kept log-prob, which can be close to 0 even when g is large; rows further apart get their
# own exp with the kept max as shift.
_SHARED_SHIFT_LIMIT = 2.0
# Finite stand-in for -inf logits where a product e^u * u would otherwise be 0 * -inf = NaN.
_NEG_FLOOR = -1.0e4

# rows of the per-token statistics (see _LogProbEntropy)
_STATS = (_M, _LOG_S, _MEAN, _M_KEPT, _LOG_S_KEPT) = (0, 1, 2, 3, 4)

# error codes per row, reported by the first bad rows
_BAD_NONFINITE, _BAD_ALL_NEG_INF, _BAD_KEPT_NEG_INF = 1, 2, 3
_BAD_MESSAGES = {
    _BAD_NONFINITE: "contain NaN or +inf (finite values and -inf are accepted)",
    _BAD_ALL_NEG_INF: "are entirely -inf (no token has any probability)",
    _BAD_KEPT_NEG_INF: "have only -inf logits among the kept ids (keep_mask plus the target)",
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the math runs in: fp64 for fp64 logits, fp32 for every other float."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_chunk_rows(n_cols: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> int:
    """Rows per chunk so that one [rows, n_cols] buffer of `dtype` fits the per-device byte budget."""
    budget = CUDA_CHUNK_BYTES if torch.device(device).type == "cuda" else CPU_CHUNK_BYTES
    row_bytes = max(1, n_cols) * torch.empty((), dtype=dtype).element_size()
    return max(1, budget // row_bytes)


def valid_local_columns(local_vocab: int, vocab_size: int | None, group: dist.ProcessGroup | None) -> int:
    """How many of this rank's columns hold real vocab ids (Megatron pads the vocab at the end)."""
    if vocab_size is None:
        return local_vocab
    return max(0, min(local_vocab, vocab_size - vocab_start(local_vocab, group)))


def row_chunks(n_rows: int, chunk_rows: int) -> Iterator[tuple[int, int]]:
    """(start, stop) row ranges covering ``range(n_rows)`` in steps of `chunk_rows`."""
    for start in range(0, n_rows, chunk_rows):
        yield start, min(n_rows, start + chunk_rows)


def row_scale(temperature: float | torch.Tensor, n_rows: int, dtype: torch.dtype) -> float | torch.Tensor:
    """1/temperature as a float, or as a [n_rows, 1] tensor of `dtype` for a per-token temperature."""
    if isinstance(temperature, torch.Tensor):
        return (1.0 / temperature.to(dtype)).expand(n_rows).reshape(n_rows, 1)
    return 1.0 / float(temperature)


def local_row_max(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-row max of unscaled logits as `dtype`; NaN mapped to +inf so a MAX all-reduce keeps it."""
    if x.size(1) == 0:
        return torch.full((x.size(0),), -math.inf, dtype=dtype, device=x.device)
    m = x.amax(dim=1).to(dtype)
    return torch.where(torch.isnan(m), math.inf, m)


def shifted_rows(
    x: torch.Tensor, shift: torch.Tensor, scale: float | torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out = (x - shift) * scale`` with a per-row `shift` in unscaled units.

    Subtracting before scaling keeps entries near the row max exact (Sterbenz), where the
    probability mass is; ``x*scale - shift*scale`` would round both terms at the logits' magnitude.
    """
    torch.sub(x, shift.unsqueeze(1), out=out)
    if isinstance(scale, torch.Tensor) or scale != 1.0:
        out.mul_(scale)
    return out


def _safe(m: torch.Tensor) -> torch.Tensor:
    """Non-finite row maxima (rows already flagged bad) replaced by 0 so the math stays quiet."""
    return torch.where(torch.isfinite(m), m, 0.0)


def _scale_rows(scale: float | torch.Tensor, start: int, stop: int) -> float | torch.Tensor:
    return scale[start:stop] if isinstance(scale, torch.Tensor) else scale


def _mul_scale(values: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    return values * (scale.squeeze(1) if isinstance(scale, torch.Tensor) else scale)


def _target_columns(
    tokens: torch.Tensor, first_id: int, n_valid: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local column of each row's target (0 where another rank owns it) and the ownership mask."""
    local = tokens.to(torch.long) - first_id
    owned = (local >= 0) & (local < n_valid)
    return torch.where(owned, local, 0), owned


def _gather_rows(values: torch.Tensor, cols: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """values[r, cols[r]] where this rank owns the target, else 0 (summed over ranks later)."""
    if values.size(1) == 0:
        return torch.zeros(values.size(0), dtype=values.dtype, device=values.device)
    picked = values.gather(1, cols.unsqueeze(1)).squeeze(1)
    return torch.where(owned, picked, 0.0)


def vocab_logsumexp(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row max m and sum S = Σ exp(z - m) of z = logits/τ over the whole (sharded) vocab.

    Streams row chunks (no [T, V] temporary), padded columns excluded, one MAX all-reduce per
    chunk and one SUM all-reduce at the end; log-sum-exp is ``m + log(S)``. Inputs are not
    validated here.
    """
    n_rows, local_vocab = logits.shape
    dtype = compute_dtype(logits.dtype)
    n_valid = valid_local_columns(local_vocab, vocab_size, group)
    scale = row_scale(temperature, n_rows, dtype)
    rows = chunk_size or default_chunk_rows(n_valid, logits.device, dtype)
    m_all = torch.empty(n_rows, dtype=dtype, device=logits.device)
    s_all = torch.empty(n_rows, dtype=dtype, device=logits.device)
    buf = torch.empty((min(rows, n_rows), n_valid), dtype=dtype, device=logits.device)
    for start, stop in row_chunks(n_rows, rows):
        x = logits[start:stop, :n_valid]
        sc = _scale_rows(scale, start, stop)
        big = _safe(all_reduce_max_(local_row_max(x, dtype), group))
        u = buf[: stop - start]
        torch.exp(shifted_rows(x, big, sc, out=u), out=u)
        m_all[start:stop] = _mul_scale(big, sc)
        s_all[start:stop] = u.sum(dim=1)
    return m_all, all_reduce_sum_(s_all, group)


@dataclass(frozen=True)
class _Spec:
    """Options of one call, fixed before the Function runs."""

    group: dist.ProcessGroup | None
    first_id: int  # global id of local column 0
    n_valid: int  # local columns that are real vocab ids
    chunk_rows: int
    with_entropy: bool
    entropy_grad: bool
    inplace_backward: bool


class _LogProbEntropy(torch.autograd.Function):
    """log p(target) (over kept ids when masked) and entropy H; saves logits + O(1) per token.

    Per token, with z = logits/τ and u = (logits - M)/τ: M = row max, S = Σ e^u, Ā = E_p[u]
    (H = log S - Ā). Kept ids: shift M_kept (= M unless the kept max lies more than
    _SHARED_SHIFT_LIMIT below it) and S_kept = Σ_kept e^((logits - M_kept)/τ). Keeping each shift
    apart from its log-sum keeps the shifted logits exact where the probability mass is, even for
    large logits; summing the other ids apart from the target keeps log p and 1 - p exact for
    confident tokens. The chunk loops only do the [rows, V] passes and the collectives; per-row
    algebra runs once over all rows.
    """

    @staticmethod
    def forward(ctx, logits, tokens, keep_mask, temperature, spec):  # type: ignore[override]
        n_rows = logits.size(0)
        dtype = compute_dtype(logits.dtype)
        dev = logits.device
        group, nv = spec.group, spec.n_valid
        masked = keep_mask is not None
        scale = row_scale(temperature, n_rows, dtype)
        cols, owned = _target_columns(tokens, spec.first_id, nv)
        x_target = _gather_rows(logits[:, :nv], cols, owned).to(dtype)  # 0 where another rank owns it

        stats = torch.zeros((len(_STATS), n_rows), dtype=dtype, device=dev)
        # per row, summed over ranks: Σ_other e^u, u_target, [Σ_other e^u·u], [Σ_kept,other, u_target - kept shift]
        n_sums = 2 + spec.with_entropy + 2 * masked
        sums = torch.zeros((n_rows, n_sums), dtype=dtype, device=dev)
        i_moment, i_kept = 2, 2 + spec.with_entropy
        has_neg_inf = False
        width = min(spec.chunk_rows, n_rows)
        u_buf = torch.empty((width, nv), dtype=dtype, device=dev)
        e_buf = torch.empty((width, nv), dtype=dtype, device=dev)
        for start, stop in row_chunks(n_rows, spec.chunk_rows):
            x = logits[start:stop, :nv]
            sc = _scale_rows(scale, start, stop)
            u, e = u_buf[: stop - start], e_buf[: stop - start]
            o = owned[start:stop]
            at_target = (torch.arange(stop - start, device=dev), cols[start:stop])  # no host sync (GPU)
            out = sums[start:stop]

            kept = None
            if masked:
                kept = keep_mask[start:stop, :nv].clone()
                if nv:
                    kept[at_target] = kept[at_target] & ~o  # the target is summed apart
                maxima = torch.stack([local_row_max(x, dtype), local_row_max(torch.where(kept, x, -math.inf), dtype)])
                maxima[1] = torch.maximum(maxima[1], torch.where(o, x_target[start:stop], -math.inf))
                maxima = all_reduce_max_(maxima, group)
                stats[_M, start:stop], stats[_M_KEPT, start:stop] = maxima
            else:
                stats[_M, start:stop] = all_reduce_max_(local_row_max(x, dtype), group)
            big = _safe(stats[_M, start:stop])

            shifted_rows(x, big, sc, out=u)
            torch.exp(u, out=e)
            if nv:  # sums over the other ids: 1 - p(target) stays exact
                e[at_target] = torch.where(o, 0.0, e[at_target])
            torch.sum(e, dim=1, out=out[:, 0])
            out[:, 1] = _mul_scale(torch.where(o, x_target[start:stop] - big, 0.0), sc)
            if spec.with_entropy:
                moment = torch.linalg.vecdot(e, u)
                nan_rows = torch.isnan(moment)
                if bool(nan_rows.any()):  # -inf logits: e^u·u = 0·(-inf); those terms are 0
                    has_neg_inf = True
                    idx = torch.nonzero(nan_rows).squeeze(1)
                    moment[idx] = torch.linalg.vecdot(e[idx], u[idx].clamp_min(_NEG_FLOOR))
                out[:, i_moment] = moment
            if masked:
                # kept ids share the shift M unless their own max lies far below it; those rows
                # (rank-consistent: maxima are all-reduced) use the kept max as their shift
                big_kept = _safe(stats[_M_KEPT, start:stop])
                far_rows = _mul_scale(big - big_kept, sc) > _SHARED_SHIFT_LIMIT
                shift_kept = torch.where(far_rows, big_kept, big)
                stats[_M_KEPT, start:stop] = shift_kept
                torch.sum(e.masked_fill_(~kept, 0.0), dim=1, out=out[:, i_kept])
                far = torch.nonzero(far_rows).squeeze(1)
                if far.numel():
                    sc_far = sc[far] if isinstance(sc, torch.Tensor) else sc
                    own = shifted_rows(x[far], shift_kept[far], sc_far, out=torch.empty_like(u[far]))
                    out[far, i_kept] = own.exp_().masked_fill_(~kept[far], 0.0).sum(dim=1)
                out[:, i_kept + 1] = _mul_scale(torch.where(o, x_target[start:stop] - shift_kept, 0.0), sc)
            all_reduce_sum_(out, group)

        # per-row algebra, once over all rows
        big = stats[_M].clone()
        bad = torch.where(torch.isposinf(big), _BAD_NONFINITE, torch.where(torch.isneginf(big), _BAD_ALL_NEG_INF, 0))
        stats[_M] = _safe(big)
        # S = S_other + e^u_t; log p = u_t - log S stays exact as p -> 1 (log1p inside logaddexp)
        stats[_LOG_S] = torch.logaddexp(sums[:, 0].log(), sums[:, 1])
        log_probs = sums[:, 1] - stats[_LOG_S]
        if spec.with_entropy:
            # Ā = E_p[u] (target term added back); H = log S - Ā. Saving Ā, not H, keeps
            # log p + H = u - Ā exact for near-uniform rows in backward.
            p_target = log_probs.exp()
            stats[_MEAN] = sums[:, i_moment] * stats[_LOG_S].neg().exp() + torch.where(
                p_target > 0, p_target * sums[:, 1], 0.0
            )
        if masked:
            stats[_LOG_S_KEPT] = torch.logaddexp(sums[:, i_kept].log(), sums[:, i_kept + 1])
            log_probs = sums[:, i_kept + 1] - stats[_LOG_S_KEPT]
            bad = torch.where((bad == 0) & torch.isneginf(stats[_LOG_S_KEPT]), _BAD_KEPT_NEG_INF, bad)
        _raise_on_bad_rows(bad)
        entropy = stats[_LOG_S] - stats[_MEAN] if spec.with_entropy else stats.new_empty(0)

        needed = []
        if not masked or spec.entropy_grad:
            needed += [_M, _LOG_S]
        if spec.entropy_grad:
            needed.append(_MEAN)
        if masked:
            needed += [_M_KEPT, _LOG_S_KEPT]
        ctx.stat_rows = {index: i for i, index in enumerate(needed)}
        ctx.spec = spec
        ctx.has_neg_inf = has_neg_inf
        ctx.masked = masked
        ctx.tensor_temperature = isinstance(temperature, torch.Tensor)
        ctx.temperature = None if ctx.tensor_temperature else temperature
        ctx.set_materialize_grads(False)
        # int32 local target column (-1: another rank owns it) instead of the int64 ids; the
        # statistics are <= 5 numbers per token: <= 24 B/token in all
        target_cols = torch.where(owned, cols, -1).to(torch.int32)
        ctx.save_for_backward(
            logits,
            target_cols,
            stats[needed].contiguous(),  # the [5, T] scratch itself is freed
            keep_mask,
            temperature if ctx.tensor_temperature else None,
        )
        if not spec.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy):  # type: ignore[override]
        logits, target_cols, stats, keep_mask, temperature = ctx.saved_tensors
        spec: _Spec = ctx.spec
        grad_entropy = grad_entropy if spec.entropy_grad else None
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None
        n_rows, local_vocab = logits.shape
        dtype = compute_dtype(logits.dtype)
        dev = logits.device
        nv = spec.n_valid
        masked = ctx.masked
        scale = row_scale(temperature if ctx.tensor_temperature else ctx.temperature, n_rows, dtype)
        owned = target_cols >= 0
        cols = target_cols.clamp_min(0).long()
        owned_rows = torch.nonzero(owned).squeeze(1)
        st = {index: stats[i] for index, i in ctx.stat_rows.items()}
        # read before the gradient (maybe the logits' own storage) is written
        x_target = logits[owned_rows, cols[owned_rows]].to(dtype)

        if spec.inplace_backward:
            # the caller allowed us to overwrite the logits: bump their version so any other
            # node that saved them fails autograd's check instead of reading the gradient
            torch.autograd.graph.increment_version(logits)
            grad = logits.detach()
        else:
            grad = torch.empty_like(logits)
        if nv < local_vocab:
            grad[:, nv:].zero_()

        # dL/dx = a·s·(onehot - p_kept) - b·s·p·(log p + H), a = dL/dlogp, b = dL/dH, s = 1/τ.
        # Per-row factors for the chunk passes (the target entries are rewritten exactly below):
        a = _mul_scale(grad_log_probs.to(dtype), scale) if grad_log_probs is not None else None
        b = _mul_scale(grad_entropy.to(dtype), scale) if grad_entropy is not None else None
        if b is None:
            shift = st[_M] if not masked else st[_M_KEPT]
            # -a·p = -(a/S)·e^u; masked: -a·e^(u_kept - log S_kept) on kept ids
            row_mul = -a * st[_LOG_S].neg().exp() if not masked else -a
        else:
            shift = st[_M]
            inv_s = st[_LOG_S].neg().exp()
            # p·(-b·(u - Ā) - a·p_kept/p) = e^u·(row_mul·u + row_add [- a·e^(-log S_kept) on kept ids])
            row_mul = -b * inv_s
            row_add = b * st[_MEAN] * inv_s
            if a is not None and not masked:
                row_add = row_add - a * inv_s
            if a is not None and masked:
                same = st[_M_KEPT] == st[_M]  # kept ids share the full shift: p_kept = e^u·e^(-log S_kept)
                kept_coef = torch.where(same, a * st[_LOG_S_KEPT].clamp_min(-_SHARED_SHIFT_LIMIT).neg().exp(), 0.0)

        width = min(spec.chunk_rows, n_rows)
        u_buf = torch.empty((width, nv), dtype=dtype, device=dev)
        q_buf = torch.empty((width, nv), dtype=dtype, device=dev) if b is not None else None
        for start, stop in row_chunks(n_rows, spec.chunk_rows):
            x = logits[start:stop, :nv]
            out = grad[start:stop, :nv]
            sc = _scale_rows(scale, start, stop)
            u = u_buf[: stop - start]
            shifted_rows(x, shift[start:stop], sc, out=u)
            kept = keep_mask[start:stop, :nv] if masked and a is not None else None

            if b is None:
                if kept is not None:
                    u.sub_(st[_LOG_S_KEPT][start:stop].unsqueeze(1)).exp_().masked_fill_(~kept, 0.0)
                else:
                    u.exp_()
                torch.mul(u, row_mul[start:stop].unsqueeze(1), out=out)
                continue
            q = q_buf[: stop - start]
            torch.exp(u, out=q)
            if ctx.has_neg_inf:
                u.clamp_min_(_NEG_FLOOR)  # q = 0 there: keep q·u at 0, not 0·inf = NaN
            u.mul_(row_mul[start:stop].unsqueeze(1)).add_(row_add[start:stop].unsqueeze(1))
            far_part = None
            if kept is not None:
                u.sub_(kept * kept_coef[start:stop].unsqueeze(1))
                far = torch.nonzero(~same[start:stop]).squeeze(1)
                if far.numel():  # kept ids with their own shift: their own exp, before `out` is written
                    sc_far = sc[far] if isinstance(sc, torch.Tensor) else sc
                    own = shifted_rows(x[far], st[_M_KEPT][start:stop][far], sc_far, out=torch.empty_like(u[far]))
                    own.sub_(st[_LOG_S_KEPT][start:stop][far].unsqueeze(1)).exp_().masked_fill_(~kept[far], 0.0)
                    far_part = (far, own.mul_(a[start:stop][far].unsqueeze(1)))
            torch.mul(q, u, out=out)
            if far_part is not None:
                far, part = far_part
                out[far] = (out[far].to(dtype) - part).to(out.dtype)
        if a is not None and owned_rows.numel():
            exact = _target_entries(x_target, owned_rows, st, scale, a, b, masked)
            grad[owned_rows, cols[owned_rows]] = exact.to(grad.dtype)
        return grad, None, None, None, None


def _target_entries(x_target, rows, st, scale, a, b, masked) -> torch.Tensor:
    """The gradient at each row's own target, with 1 - p as -expm1(log p).

    a·(1 - p) computed as a - a·p loses all relative precision as p -> 1 (confident tokens); the
    chunk passes write that entry first, then this exact value replaces it.
    """
    s = scale[rows].squeeze(1) if isinstance(scale, torch.Tensor) else scale
    u_target = (x_target - st[_M][rows]) * s if _M in st else None
    log_p = u_target - st[_LOG_S][rows] if u_target is not None else None
    log_p_kept = (x_target - st[_M_KEPT][rows]) * s - st[_LOG_S_KEPT][rows] if masked else log_p
    grad = a[rows] * -torch.expm1(log_p_kept)
    if b is not None:  # -b·p·(log p + H) = -b·p·(u - Ā)
        term = torch.where(torch.isneginf(log_p), 0.0, log_p.exp() * (u_target - st[_MEAN][rows]))
        grad = grad - b[rows] * term
    return grad


def _raise_on_bad_rows(bad: torch.Tensor) -> None:
    """One sync: raise ValueError naming the first bad rows (every rank sees the same codes)."""
    if bad.numel() == 0 or not bool(bad.any()):
        return
    first = int(torch.nonzero(bad)[0, 0])
    code = int(bad[first])
    rows = torch.nonzero(bad == code).squeeze(1)[:8].tolist()
    raise ValueError(
        f"log_probs_and_entropy: logits rows {rows} {_BAD_MESSAGES[code]} "
        f"({int((bad != 0).sum())} bad row(s) in total); fix the logits of those rows before the loss"
    )


def _check_inputs(
    logits, tokens, tp_group, temperature, chunk_size, keep_mask, vocab_size, inplace_backward
) -> None:
    """Raise TypeError/ValueError naming the argument before anything is computed."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor [T, V_local], got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating tensor (fp16/bf16/fp32/fp64), got dtype {logits.dtype}")
    if logits.dim() != 2:
        raise ValueError(
            f"logits must be 2-D [T, V_local], got shape {tuple(logits.shape)}; flatten batch/sequence "
            f"dims first, e.g. logits.reshape(-1, logits.size(-1))"
        )
    n_rows, local_vocab = logits.shape
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a torch.Tensor [T] of global token ids, got {type(tokens).__name__}")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise TypeError(f"tokens must be an integer tensor (int64/int32), got dtype {tokens.dtype}")
    if tokens.shape != (n_rows,):
        raise ValueError(
            f"tokens must have shape [T] = ({n_rows},) to match logits {tuple(logits.shape)}, "
            f"got {tuple(tokens.shape)}"
        )
    if tokens.device != logits.device:
        raise ValueError(f"tokens are on {tokens.device} but logits on {logits.device}; move them together")
    if tp_group is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("tp_group was given but torch.distributed is not initialized; pass tp_group=None")
    if local_vocab == 0:
        raise ValueError("logits have no vocab columns (V_local = 0)")
    full_vocab = local_vocab * tp_size(tp_group)
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
            raise TypeError(f"vocab_size must be an int or None, got {type(vocab_size).__name__}")
        if not 1 <= vocab_size <= full_vocab:
            raise ValueError(
                f"vocab_size must be in [1, V_local * tp_size] = [1, {full_vocab}] (the unpadded vocab), "
                f"got {vocab_size}"
            )
    vocab = vocab_size if vocab_size is not None else full_vocab
    if n_rows and bool(((tokens < 0) | (tokens >= vocab)).any()):
        bad = torch.nonzero((tokens < 0) | (tokens >= vocab)).squeeze(1)[:8].tolist()
        raise ValueError(
            f"tokens must be global ids in [0, {vocab}); rows {bad} are outside (e.g. {int(tokens[bad[0]])}); "
            f"mask padding targets with a valid id such as 0 and drop those rows from the loss"
        )
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point() or temperature.shape not in ((), (n_rows,)):
            raise ValueError(
                f"temperature tensor must be floating with shape [] or [T] = ({n_rows},), "
                f"got dtype {temperature.dtype} shape {tuple(temperature.shape)}"
            )
        if temperature.requires_grad:
            raise ValueError("temperature must not require grad (it is a sampling constant); pass .detach()")
        if temperature.device != logits.device:
            raise ValueError(f"temperature is on {temperature.device} but logits on {logits.device}")
        if temperature.numel() and not bool(((temperature > 0) & torch.isfinite(temperature)).all()):
            raise ValueError("temperature must be finite and > 0 for every token")
    else:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(f"temperature must be a float or a [T] tensor, got {type(temperature).__name__}")
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None (byte-budget default) or an int >= 1 rows, got {chunk_size!r}")
    if keep_mask is not None:
        if not isinstance(keep_mask, torch.Tensor) or keep_mask.dtype != torch.bool:
            got = keep_mask.dtype if isinstance(keep_mask, torch.Tensor) else type(keep_mask).__name__
            raise TypeError(f"keep_mask must be a bool tensor [T, V_local], got {got}")
        if keep_mask.shape != logits.shape:
            raise ValueError(
                f"keep_mask must have the logits' shape {tuple(logits.shape)}, got {tuple(keep_mask.shape)}"
            )
        if keep_mask.device != logits.device:
            raise ValueError(f"keep_mask is on {keep_mask.device} but logits on {logits.device}")
    if inplace_backward:
        if logits.requires_grad and logits.is_leaf:
            raise ValueError(
                "inplace_backward=True would overwrite a leaf tensor's values with its gradient; use it only "
                "for logits produced by the model (a non-leaf), or pass inplace_backward=False"
            )
        if n_rows > 1 and (logits.stride(1) != 1 or logits.stride(0) < local_vocab):
            raise ValueError(
                f"inplace_backward=True needs logits whose rows do not overlap in memory "
                f"(strides {logits.stride()}); pass logits.contiguous() or inplace_backward=False"
            )


def log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float | torch.Tensor = 1.0,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
    chunk_size: int | None = None,
    keep_mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) and entropy of softmax(logits/τ) over a vocab sharded on `tp_group`.

    logits [T, V_local] (this rank's vocab shard; `tp_group=None` = no tensor parallelism),
    tokens [T] global ids. Keeps only the logits plus ≤ 24 B/token for backward. `keep_mask`
    normalizes the log-prob over the kept ids (the target always kept); entropy stays over the
    full distribution. Columns with global id >= `vocab_size` are ignored. With
    `inplace_backward=True` the gradient is written into the logits' storage: nothing else may
    need those logits in backward (autograd raises if something does). Outputs are fp32 (fp64 for
    fp64 logits); entropy is None unless `with_entropy`.
    """
    _check_inputs(logits, tokens, tp_group, temperature, chunk_size, keep_mask, vocab_size, inplace_backward)
    local_vocab = logits.size(1)
    n_valid = valid_local_columns(local_vocab, vocab_size, tp_group)
    dtype = compute_dtype(logits.dtype)
    spec = _Spec(
        group=tp_group,
        first_id=vocab_start(local_vocab, tp_group),
        n_valid=n_valid,
        chunk_rows=chunk_size or default_chunk_rows(n_valid, logits.device, dtype),
        with_entropy=bool(with_entropy),
        entropy_grad=bool(with_entropy and entropy_requires_grad),
        inplace_backward=bool(inplace_backward),
    )
    log_probs, entropy = _LogProbEntropy.apply(logits, tokens, keep_mask, temperature, spec)
    return log_probs, (entropy if with_entropy else None)
