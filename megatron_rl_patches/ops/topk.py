"""Top-k on-policy distillation: vocab-parallel top-k ids, full-vocab log-probs at those ids plus
an exact tail bucket, and the (k+1)-bucket KL to a mixture of teachers (docs/topk-opd.md).

Everything is per token, so packed `thd`, CP-zigzag and allgather-CP tensors all work as long as
every input uses the same token layout; nothing here shifts tokens. Memory stays O(T·k) beyond
the logits: rows are processed in chunks and backward recomputes the softmax chunk by chunk.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron_rl_patches.ops import _dist

__all__ = ["topk_ids", "topk_logprobs", "topk_opd_loss"]

KL_KINDS = ("reverse", "forward", "mixed")
# Elements of one row chunk when chunk_size is None: 16 Mi fp32 values (64 MiB) per buffer.
_CHUNK_ELEMENTS = 1 << 24
_NEG_INF = float("-inf")

Temperature = Union[float, torch.Tensor]
Weights = Union[torch.Tensor, Sequence[float], None]


# ----------------------------------------------------------------------------- validation
def _check_logits(logits: object, name: str) -> tuple[torch.Size, int]:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [T, V_local], got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {logits.dtype}; pass the model's logits")
    if logits.dim() < 2 or logits.shape[-1] == 0:
        raise ValueError(
            f"{name} must have shape [T, V_local] (or [..., V_local]) with V_local > 0, got {tuple(logits.shape)}"
        )
    return logits.shape[:-1], logits.shape[-1]


def _global_vocab(local_vocab: int, tp_group: Optional[dist.ProcessGroup], vocab_size: object) -> int:
    padded = local_vocab * _dist.tp_size(tp_group)
    if vocab_size is None:
        return padded
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        raise TypeError(f"vocab_size must be an int or None, got {type(vocab_size).__name__}")
    if not 1 <= int(vocab_size) <= padded:
        raise ValueError(
            f"vocab_size must be in [1, {padded}] (V_local {local_vocab} x tensor-parallel size "
            f"{_dist.tp_size(tp_group)}), got {vocab_size}; pass the unpadded global vocabulary size"
        )
    return int(vocab_size)


def _check_k(k: int, vocab: int, name: str = "k") -> None:
    if k >= vocab:
        raise ValueError(
            f"{name} must be smaller than the vocabulary size {vocab} (global, after vocab_size) so that "
            f"the tail bucket is not empty, got {k}; use a smaller k"
        )


def _check_ids(ids: object, lead: torch.Size, vocab: int) -> int:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor of global vocab ids [T, k], got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor (torch.long), got dtype {ids.dtype}")
    if ids.dim() != len(lead) + 1 or ids.shape[:-1] != lead or ids.shape[-1] == 0:
        raise ValueError(
            f"ids must have shape {tuple(lead) + ('k',)} (the logits' leading dims, then k >= 1), "
            f"got {tuple(ids.shape)}"
        )
    k = ids.shape[-1]
    _check_k(k, vocab, "ids.shape[-1] (k)")
    if ids.numel():
        if bool(((ids < 0) | (ids >= vocab)).any()):
            bad = ids[(ids < 0) | (ids >= vocab)][0].item()
            raise ValueError(f"ids must be global vocab ids in [0, {vocab}), found {bad}; check vocab_size and tp_group")
        ordered = ids.sort(dim=-1).values
        if k > 1 and bool((ordered[..., 1:] == ordered[..., :-1]).any()):
            raise ValueError("ids must not repeat within a row (each id is one bucket); deduplicate them, e.g. use topk_ids")
    return k


def _check_int_k(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or int(k) < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    return int(k)


def _check_chunk_size(chunk_size: object, local_vocab: int) -> int:
    if chunk_size is None:
        return max(1, _CHUNK_ELEMENTS // (local_vocab + 1))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be a positive int (rows per chunk) or None, got {chunk_size!r}")
    return int(chunk_size)


def _check_temperature(temperature: object, lead: torch.Size, dtype: torch.dtype, device: torch.device) -> Temperature:
    """Returns a positive float, or a flat [T] tensor of per-token temperatures."""
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point():
            raise TypeError(f"temperature must be a float or a floating tensor, got dtype {temperature.dtype}")
        if temperature.dim() == 0:
            temperature = float(temperature.item())
        elif temperature.shape != lead:
            raise ValueError(
                f"a temperature tensor must have shape {tuple(lead)} (one value per token), got {tuple(temperature.shape)}"
            )
        else:
            tau = temperature.detach().to(device=device, dtype=dtype).reshape(-1)
            if tau.numel() and not bool((torch.isfinite(tau) & (tau > 0)).all()):
                raise ValueError("temperature must be finite and > 0 for every token; check the per-token temperatures")
            return tau
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a float or a tensor of shape {tuple(lead)}, got {type(temperature).__name__}")
    if not (math.isfinite(float(temperature)) and float(temperature) > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    return float(temperature)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- top-k ids
def _local_topk(x: torch.Tensor, k: int, sentinel: int, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's k best columns per row, ties at the cut resolved towards lower ids; missing
    candidates (fewer than k valid columns) are padded with (-inf, sentinel)."""
    rows, cols = x.shape
    keep = min(k, cols)
    if keep == 0:
        values = x.new_full((rows, 0), _NEG_INF)
        index = torch.empty((rows, 0), dtype=torch.long, device=x.device)
    else:
        values, index = torch.topk(x, min(keep + 1, cols), dim=-1)
        if values.shape[-1] > keep:
            # torch.topk picks arbitrarily among values equal at the cut; redo those rows with a stable sort.
            tied = (values[:, keep - 1] == values[:, keep]).nonzero().squeeze(1)
            values, index = values[:, :keep].contiguous(), index[:, :keep].contiguous()
            step = max(1, _CHUNK_ELEMENTS // cols)
            for start in range(0, tied.numel(), step):
                sel = tied[start:start + step]
                best = torch.sort(x[sel], dim=-1, descending=True, stable=True)
                values[sel] = best.values[:, :keep]
                index[sel] = best.indices[:, :keep]
    if keep < k:
        values = torch.cat([values, values.new_full((rows, k - keep), _NEG_INF)], dim=-1)
        index = torch.cat([index, index.new_full((rows, k - keep), sentinel)], dim=-1)
    return values, index


def _merge_candidates(values: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """The k best (value descending, then id ascending) among each row's candidates."""
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    best = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]
    return ids.gather(-1, best)


def topk_ids(
    logits: torch.Tensor,
    k: int,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Global vocab ids of the k largest logits per row, descending (ties: lower id first).

    Vocab-parallel: each rank takes its local top-k and the ranks all-gather k candidates each
    (O(T·k·tp) communication); every rank returns the same ids. Padded columns (ids >=
    `vocab_size`) are never selected. No gradient.
    """
    lead, local_vocab = _check_logits(logits, "logits")
    k = _check_int_k(k)
    vocab = _global_vocab(local_vocab, tp_group, vocab_size)
    _check_k(k, vocab)
    with torch.no_grad():
        flat = logits.detach().reshape(-1, local_vocab)
        offset = _dist.vocab_start(local_vocab, tp_group)
        valid = max(0, min(local_vocab, vocab - offset))
        values, index = _local_topk(flat[:, :valid], k, vocab - offset, max(1, _CHUNK_ELEMENTS // local_vocab))
        ids = index + offset
        values = _dist.all_gather_last_dim(values, tp_group)
        ids = _dist.all_gather_last_dim(ids, tp_group)
        ids = _merge_candidates(values, ids, k)
    return ids.reshape(*lead, k)


# ----------------------------------------------------------------------------- top-k log-probs
def _scaled_chunk(
    logits: torch.Tensor, start: int, stop: int, tau: Temperature, valid: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows [start, stop) as z = logits / tau in `dtype`, padded columns set to -inf, plus one
    extra -inf column that ids owned by other ranks point at (so scatter/gather need no mask)."""
    local_vocab = logits.shape[1]
    buf = torch.empty((stop - start, local_vocab + 1), dtype=dtype, device=logits.device)
    body = buf[:, :local_vocab]
    body.copy_(logits[start:stop])
    if isinstance(tau, torch.Tensor):
        body.div_(tau[start:stop, None])
    elif tau != 1.0:
        body.div_(tau)
    buf[:, valid:] = _NEG_INF
    return buf


def _max_and_log_sum(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the max m (0 for an all -inf row) and log sum exp(z - m) (-inf for that row).

    Kept apart rather than as one log-sum-exp: with |z| ~ 40, m + log S rounded to float32 is
    off by ~2e-6, while z - m and log S (at most log V) stay exact to float32 epsilon.
    """
    peak = buf.amax(dim=-1)
    peak = torch.where(torch.isfinite(peak), peak, 0.0)
    return peak, torch.exp(buf - peak[:, None]).sum(dim=-1).log()


class _TopkLogprobs(torch.autograd.Function):
    """(log p at ids, log tail mass) over the full (vocab-parallel) vocabulary.

    Saves the logits, the ids and four floats per row (max and log-sum of all columns and of the
    columns not in ids); backward recomputes the softmax chunk by chunk and needs no collective.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        ids: torch.Tensor,
        tau: Temperature,
        tp_group: Optional[dist.ProcessGroup],
        vocab: int,
        chunk_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, local_vocab = logits.shape
        dtype = _work_dtype(logits.dtype)
        offset = _dist.vocab_start(local_vocab, tp_group)
        valid = max(0, min(local_vocab, vocab - offset))
        local, owned = _local_ids(ids, offset, local_vocab)

        # columns: max, log-sum over all columns; max, log-sum over the columns not in ids
        stats = torch.empty((rows, 4), dtype=dtype, device=logits.device)
        z_ids = torch.empty(ids.shape, dtype=dtype, device=logits.device)
        for start in range(0, rows, chunk_rows):
            stop = min(rows, start + chunk_rows)
            buf = _scaled_chunk(logits, start, stop, tau, valid, dtype)
            stats[start:stop, 0], stats[start:stop, 1] = _max_and_log_sum(buf)
            z_ids[start:stop] = buf.gather(1, local[start:stop])
            # The tail comes from the complement's own log-sum-exp, never from log(1 - sum p):
            # that form returns 0 or noise once the tail mass drops below the dtype's epsilon.
            buf.scatter_(1, local[start:stop], _NEG_INF)
            stats[start:stop, 2], stats[start:stop, 3] = _max_and_log_sum(buf)

        if _dist.tp_size(tp_group) > 1:
            stats, z_ids = _combine_ranks(stats, torch.where(owned, z_ids, 0.0), tp_group)

        ctx.tau_value = tau if not isinstance(tau, torch.Tensor) else None
        tau_tensor = tau if isinstance(tau, torch.Tensor) else stats.new_empty(0)
        ctx.save_for_backward(logits, ids, stats, tau_tensor)
        ctx.tp_group, ctx.vocab, ctx.chunk_rows = tp_group, vocab, chunk_rows
        ctx.set_materialize_grads(False)
        peak, log_sum, peak_tail, log_sum_tail = stats.unbind(1)
        logp = (z_ids - peak[:, None]) - log_sum[:, None]
        tail = (peak_tail - peak) + (log_sum_tail - log_sum)
        return logp, tail

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_logp: Optional[torch.Tensor],
        grad_tail: Optional[torch.Tensor],
    ) -> tuple[Optional[torch.Tensor], None, None, None, None, None]:
        logits, ids, stats, tau_tensor = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_logp is None and grad_tail is None):
            return None, None, None, None, None, None
        tau: Temperature = tau_tensor if ctx.tau_value is None else ctx.tau_value
        rows, local_vocab = logits.shape
        dtype = stats.dtype
        offset = _dist.vocab_start(local_vocab, ctx.tp_group)
        valid = max(0, min(local_vocab, ctx.vocab - offset))
        local, owned = _local_ids(ids, offset, local_vocab)
        peak, log_sum, peak_tail, log_sum_tail = stats.unbind(1)

        g = grad_logp.to(dtype) if grad_logp is not None else stats.new_zeros(ids.shape)
        has_tail = grad_tail is not None
        # An empty tail (log mass -inf) is a constant: it gets no gradient.
        tail_finite = torch.isfinite(log_sum_tail)
        g_tail = torch.where(tail_finite, grad_tail.to(dtype), 0.0) if has_tail else stats.new_zeros(rows)
        log_sum_tail = torch.where(tail_finite, log_sum_tail, 0.0)
        total = g.sum(dim=1) + g_tail
        g_owned = torch.where(owned, g, 0.0)

        # dlogp_i/dz_j = [i == j] - p_j ; dtail/dz_j = [j not in ids] p_j / P_tail - p_j ; dz/dx = 1/tau
        grad = torch.empty_like(logits)
        for start in range(0, rows, ctx.chunk_rows):
            stop = min(rows, start + ctx.chunk_rows)
            buf = _scaled_chunk(logits, start, stop, tau, valid, dtype)
            out = (buf - peak[start:stop, None]).sub_(log_sum[start:stop, None]).exp_()
            out.mul_(-total[start:stop, None])
            if has_tail:
                buf.scatter_(1, local[start:stop], _NEG_INF)
                # p_j / P_tail as exp(z_j - lse_tail): no division of two tiny numbers
                buf.sub_(peak_tail[start:stop, None]).sub_(log_sum_tail[start:stop, None]).exp_()
                out.add_(buf.mul_(g_tail[start:stop, None]))
            out.scatter_add_(1, local[start:stop], g_owned[start:stop])
            body = out[:, :local_vocab]
            if isinstance(tau, torch.Tensor):
                body.div_(tau[start:stop, None])
            elif tau != 1.0:
                body.div_(tau)
            grad[start:stop] = body
        return grad, None, None, None, None, None


def _local_ids(ids: torch.Tensor, offset: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local column of each id; ids of other ranks point at the extra column `local_vocab`."""
    local = ids - offset
    owned = (local >= 0) & (local < local_vocab)
    return torch.where(owned, local, local_vocab), owned


def _combine_ranks(
    stats: torch.Tensor, z_ids: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global (max, log-sum) pairs from per-rank ones with one MAX and one SUM all-reduce of
    O(T·k) values; `z_ids` holds each rank's own ids' logits and zeros elsewhere."""
    peaks, log_sums = stats[:, 0::2], stats[:, 1::2]
    # an empty rank (log-sum -inf) must not take part in the max with its placeholder 0
    peak = _dist.all_reduce_max_(torch.where(torch.isinf(log_sums), _NEG_INF, peaks), group)
    peak = torch.where(torch.isfinite(peak), peak, 0.0)
    packed = _dist.all_reduce_sum_(torch.cat([torch.exp(log_sums + (peaks - peak)), z_ids], dim=1), group)
    log_sum = packed[:, :2].log()
    combined = torch.stack([peak[:, 0], log_sum[:, 0], peak[:, 1], log_sum[:, 1]], dim=1)
    return combined, packed[:, 2:].contiguous()


def _topk_logprobs_checked(
    logits: torch.Tensor,
    ids: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup],
    temperature: object,
    vocab_size: object,
    chunk_size: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Size, int]:
    lead, local_vocab = _check_logits(logits, "logits")
    vocab = _global_vocab(local_vocab, tp_group, vocab_size)
    k = _check_ids(ids, lead, vocab)
    tau = _check_temperature(temperature, lead, _work_dtype(logits.dtype), logits.device)
    chunk_rows = _check_chunk_size(chunk_size, local_vocab)
    flat_ids = ids.reshape(-1, k).to(device=logits.device, dtype=torch.long)
    logp, tail = _TopkLogprobs.apply(logits.reshape(-1, local_vocab), flat_ids, tau, tp_group, vocab, chunk_rows)
    return logp, tail, lead, k


def topk_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: Temperature = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (normalized over the full vocab, logits / temperature) at `ids` [T, k] and the
    log of the remaining mass [T], from the complement's log-sum-exp; differentiable.

    `tp_group`/`vocab_size` as in `log_probs_and_entropy`: logits [T, V_local] sharded over
    `tp_group` (None: no tensor parallelism), ids global, padded columns excluded. Output is
    float32 (float64 for float64 logits). `chunk_size` is rows per chunk (None: automatic).
    """
    logp, tail, lead, k = _topk_logprobs_checked(logits, ids, tp_group, temperature, vocab_size, chunk_size)
    return logp.reshape(*lead, k), tail.reshape(lead)


# ----------------------------------------------------------------------------- OPD loss
def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler's two branches)."""
    near_zero = x > -math.log(2.0)
    return torch.where(near_zero, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _derived_tail(logprobs: torch.Tensor, source_dtype: torch.dtype) -> torch.Tensor:
    """Teacher tail log-mass from its top-k log-probs alone: log(1 - sum_k q), floored.

    From k rounded log-probs the tail is only known to about the dtype's epsilon, and rounding
    can make sum_k q reach or exceed 1; the mass is floored at the epsilon of the dtype the
    teacher log-probs came in (`source_dtype`), so the tail stays finite.
    """
    floor = math.log(max(torch.finfo(source_dtype).eps, torch.finfo(logprobs.dtype).eps))
    covered = torch.logsumexp(logprobs, dim=-1).clamp(max=0.0)
    return _log1mexp(covered).clamp(min=floor)


def _kl_rows(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """sum_b a_b (log a_b - log b_b) with 0·log 0 = 0 and +inf where b_b = 0 < a_b.

    Built with where() on finite stand-ins so -inf entries give neither NaN values nor NaN
    gradients; an infinite bucket contributes no gradient.
    """
    a_pos = log_a > _NEG_INF
    b_pos = log_b > _NEG_INF
    la = torch.where(a_pos, log_a, 0.0)
    lb = torch.where(b_pos, log_b, 0.0)
    terms = torch.where(a_pos & b_pos, torch.exp(la) * (la - lb), 0.0)
    terms = torch.where(a_pos & ~b_pos, math.inf, terms)
    return terms.sum(dim=-1)


def _check_teachers(
    teacher_logprobs: object, teacher_tail_logprobs: object, ids_shape: torch.Size
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Teacher tensors as [n, *ids_shape] and [n, *ids_shape[:-1]] (tail None when derived)."""
    if not isinstance(teacher_logprobs, torch.Tensor) or not teacher_logprobs.is_floating_point():
        raise TypeError("teacher_logprobs must be a floating tensor [n_teachers, T, k] or [T, k]")
    if teacher_logprobs.shape == ids_shape:
        teacher_logprobs = teacher_logprobs.unsqueeze(0)
        single = True
    elif teacher_logprobs.dim() == len(ids_shape) + 1 and teacher_logprobs.shape[1:] == ids_shape:
        single = False
    else:
        raise ValueError(
            f"teacher_logprobs must have shape {tuple(ids_shape)} (one teacher) or "
            f"(n_teachers, *{tuple(ids_shape)}), like ids; got {tuple(teacher_logprobs.shape)}"
        )
    if teacher_logprobs.shape[0] == 0:
        raise ValueError("teacher_logprobs must hold at least one teacher, got n_teachers = 0")
    if teacher_tail_logprobs is None:
        return teacher_logprobs, None
    if not isinstance(teacher_tail_logprobs, torch.Tensor) or not teacher_tail_logprobs.is_floating_point():
        raise TypeError("teacher_tail_logprobs must be a floating tensor [n_teachers, T] or [T], or None")
    expected = tuple(teacher_logprobs.shape[:-1])[1:] if single else tuple(teacher_logprobs.shape[:-1])
    if tuple(teacher_tail_logprobs.shape) != expected:
        raise ValueError(
            f"teacher_tail_logprobs must have shape {expected} to match teacher_logprobs "
            f"{tuple(teacher_logprobs.shape[1:] if single else teacher_logprobs.shape)}, "
            f"got {tuple(teacher_tail_logprobs.shape)}"
        )
    tail = teacher_tail_logprobs.unsqueeze(0) if single else teacher_tail_logprobs
    return teacher_logprobs, tail


def _check_weights(weights: Weights, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Log of the teacher weights normalized to sum 1 ([n]; uniform when None)."""
    if weights is None:
        return torch.full((n,), -math.log(n), dtype=dtype, device=device)
    if isinstance(weights, torch.Tensor):
        w = weights.detach().to(device=device, dtype=torch.float64)
    else:
        try:
            w = torch.tensor([float(x) for x in weights], dtype=torch.float64, device=device)
        except (TypeError, ValueError):
            raise TypeError(f"teacher_weights must be a sequence of {n} numbers or a tensor [{n}], got {weights!r}") from None
    if w.shape != (n,):
        raise ValueError(f"teacher_weights must have shape ({n},), one weight per teacher, got {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"teacher_weights must be finite and >= 0, got {w.tolist()}")
    total = w.sum()
    if not bool(total > 0):
        raise ValueError("teacher_weights must not all be zero: give at least one teacher a positive weight")
    return torch.log(w / total).to(dtype)


def topk_opd_loss(
    student_logits: torch.Tensor,
    ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    teacher_tail_logprobs: Optional[torch.Tensor] = None,
    *,
    teacher_weights: Weights = None,
    kl: str = "reverse",
    mix: float = 0.5,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: Temperature = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Per-token KL [T] between the student's and the teacher mixture's (k+1)-bucket
    distributions (the k ids plus one tail bucket); gradient flows to the student logits only.

    kl: "reverse" sum p (log p - log q), "forward" sum q (log q - log p), "mixed"
    mix·forward + (1 - mix)·reverse. The mixture is q = sum_j w_j q_j (w normalized, default
    uniform); teacher tails default to log(1 - sum_k q_j), computed stably and floored at the
    dtype's epsilon. Zero-probability buckets: 0·log 0 = 0; a bucket with zero probability on
    the reference side only makes that token's KL +inf (that bucket gives no gradient).
    """
    if not isinstance(kl, str) or kl not in KL_KINDS:
        raise ValueError(f"kl must be one of {KL_KINDS}, got {kl!r}")
    if isinstance(mix, bool) or not isinstance(mix, numbers.Real) or not 0.0 <= float(mix) <= 1.0:
        raise ValueError(f"mix must be a float in [0, 1] (the forward-KL share of kl='mixed'), got {mix!r}")
    lead, _ = _check_logits(student_logits, "student_logits")
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor of global vocab ids [T, k], got {type(ids).__name__}")
    teachers, teacher_tails = _check_teachers(teacher_logprobs, teacher_tail_logprobs, ids.shape)
    dtype = _work_dtype(student_logits.dtype)
    log_w = _check_weights(teacher_weights, teachers.shape[0], dtype, student_logits.device)

    logp, tail, lead, k = _topk_logprobs_checked(student_logits, ids, tp_group, temperature, vocab_size, chunk_size)
    log_p = torch.cat([logp, tail[:, None]], dim=1)

    n, source_dtype = teachers.shape[0], teachers.dtype
    teachers = teachers.detach().to(device=student_logits.device, dtype=dtype).reshape(n, -1, k)
    if teacher_tails is None:
        teacher_tails = _derived_tail(teachers, source_dtype)
    else:
        teacher_tails = teacher_tails.detach().to(device=student_logits.device, dtype=dtype).reshape(n, -1)
    log_qs = torch.cat([teachers, teacher_tails[..., None]], dim=-1)
    log_q = log_qs[0] if n == 1 else torch.logsumexp(log_qs + log_w[:, None, None], dim=0)

    mix = float(mix)
    if kl == "reverse" or (kl == "mixed" and mix == 0.0):
        loss = _kl_rows(log_p, log_q)
    elif kl == "forward" or mix == 1.0:
        loss = _kl_rows(log_q, log_p)
    else:  # computed apart so that 0·inf never appears for mix in {0, 1}
        loss = mix * _kl_rows(log_q, log_p) + (1.0 - mix) * _kl_rows(log_p, log_q)
    return loss.reshape(lead)
