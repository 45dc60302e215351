"""Per-token log-prob and entropy over vocab-parallel ``[T, V_local]`` logits at the memory floor.

One autograd Function walks the rows in chunks. Between forward and backward it keeps only the
input logits (through ``save_for_backward``) and a few numbers per token; backward recomputes the
softmax chunk by chunk, and with ``inplace_backward=True`` writes the gradient into the logits'
own storage. With tensor parallelism the forward needs one MAX and one SUM all-reduce of O(T)
values per call and the backward none; the streaming core lives in :mod:`._vocab`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron_rl_patches.ops import _vocab
from megatron_rl_patches.ops._dist import vocab_start

__all__ = ["log_probs_and_entropy"]

# rows of the per-token statistics (see _LogProbEntropy)
_STATS = (_M, _LOG_S, _MEAN, _M_KEPT, _LOG_S_KEPT) = (0, 1, 2, 3, 4)



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
    SHARED_SHIFT_LIMIT below it) and S_kept = Σ_kept e^((logits - M_kept)/τ). Keeping each shift
    apart from its log-sum keeps the shifted logits exact where the probability mass is, even for
    large logits; summing the other ids apart from the target keeps log p and 1 - p exact for
    confident tokens. Host syncs: one per forward (validation; two with keep_mask), none in backward.
    """

    @staticmethod
    def forward(ctx, logits, tokens, keep_mask, temperature, spec, checks):  # type: ignore[override]
        n_rows = logits.size(0)
        dtype = _vocab.compute_dtype(logits.dtype)
        masked = keep_mask is not None
        scale = _vocab.row_scale(temperature, n_rows, dtype)
        cols, owned = _vocab.local_columns(tokens, spec.first_id, spec.n_valid)
        vs = _vocab.vocab_stats(
            logits,
            cols.unsqueeze(1),
            owned.unsqueeze(1),
            scale,
            _vocab.StatsSpec(spec.group, spec.n_valid, spec.chunk_rows, moment=spec.with_entropy,
                             subset=masked, marked_in_subset_max=True),
            keep_mask,
        )
        x_target = vs.marked[:, 0]

        stats = torch.zeros((len(_STATS), n_rows), dtype=dtype, device=logits.device)
        bad = _vocab.bad_row_codes(vs.raw_max)
        stats[_M] = vs.shift
        u_target = _vocab.mul_scale(x_target - vs.shift, scale)
        # S = S_other + e^u_t; log p = u_t - log S stays exact as p -> 1 (log1p inside logaddexp)
        stats[_LOG_S] = torch.logaddexp(vs.rest.log(), u_target)
        log_probs = u_target - stats[_LOG_S]
        if spec.with_entropy:
            # Ā = E_p[u] (target term added back); H = log S - Ā. Saving Ā, not H, keeps
            # log p + H = u - Ā exact for near-uniform rows in backward.
            p_target = log_probs.exp()
            stats[_MEAN] = vs.moment * stats[_LOG_S].neg().exp() + torch.where(
                p_target > 0, p_target * u_target, 0.0
            )
        if masked:
            stats[_M_KEPT] = vs.subset_shift
            u_kept = _vocab.mul_scale(x_target - vs.subset_shift, scale)
            stats[_LOG_S_KEPT] = torch.logaddexp(vs.subset_sum.log(), u_kept)
            log_probs = u_kept - stats[_LOG_S_KEPT]
            bad = torch.where((bad == 0) & torch.isneginf(stats[_LOG_S_KEPT]), _vocab.BAD_KEPT_NEG_INF, bad)
        checks.require(bad == 0, lambda: _vocab.bad_rows_error("log_probs_and_entropy", "logits", bad))
        checks.raise_first()  # the forward's host sync: input checks and bad rows at once
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
        ctx.masked = masked
        ctx.kept_far_rows = vs.far_rows  # rows whose kept ids have their own shift (host list)
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
    @_vocab.reject_double_backward
    def backward(ctx, grad_log_probs, grad_entropy):  # type: ignore[override]
        logits, target_cols, stats, keep_mask, temperature = ctx.saved_tensors
        spec: _Spec = ctx.spec
        grad_entropy = grad_entropy if spec.entropy_grad else None
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None
        n_rows, local_vocab = logits.shape
        dtype = _vocab.compute_dtype(logits.dtype)
        dev = logits.device
        nv = spec.n_valid
        masked = ctx.masked
        scale = _vocab.row_scale(temperature if ctx.tensor_temperature else ctx.temperature, n_rows, dtype)
        owned = target_cols >= 0
        at_target = (torch.arange(n_rows, device=dev), target_cols.clamp_min(0).long())
        st = {index: stats[i] for index, i in ctx.stat_rows.items()}
        # read before the gradient (maybe the logits' own storage) is written; rows whose target
        # another rank owns read column 0 and are never used
        x_target = logits[at_target].to(dtype)

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
        a = _vocab.mul_scale(grad_log_probs.to(dtype), scale) if grad_log_probs is not None else None
        b = _vocab.mul_scale(grad_entropy.to(dtype), scale) if grad_entropy is not None else None
        far_rows: list[int] = []
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
                limit = _vocab.SHARED_SHIFT_LIMIT
                kept_coef = torch.where(same, a * st[_LOG_S_KEPT].clamp_min(-limit).neg().exp(), 0.0)
                far_rows = ctx.kept_far_rows  # the other rows: their kept ids get their own exp

        width = min(spec.chunk_rows, n_rows)
        u_buf = torch.empty((width, nv), dtype=dtype, device=dev)
        q_buf = torch.empty((width, nv), dtype=dtype, device=dev) if b is not None else None
        w_buf = torch.empty((width, nv), dtype=dtype, device=dev) if far_rows else None
        for start, stop in _vocab.row_chunks(n_rows, spec.chunk_rows):
            x = logits[start:stop, :nv]
            out = grad[start:stop, :nv]
            sc = _vocab.scale_rows(scale, slice(start, stop))
            u = u_buf[: stop - start]
            _vocab.shifted_rows(x, shift[start:stop], sc, out=u)
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
            u.clamp_min_(_vocab.NEG_FLOOR)  # q = 0 there: keep q·u at 0, not 0·inf = NaN
            u.mul_(row_mul[start:stop].unsqueeze(1)).add_(row_add[start:stop].unsqueeze(1))
            far = None
            if kept is not None:
                u.sub_(kept * kept_coef[start:stop].unsqueeze(1))
                far = _vocab.rows_in_chunk(far_rows, start, stop, dev)
            if far is not None:  # computed before `out` (maybe the logits themselves) is written
                own = w_buf[: stop - start if isinstance(far, slice) else far.numel()]
                i = slice(start, stop)
                _vocab.own_shift_exp(x[far], st[_M_KEPT][i][far], st[_LOG_S_KEPT][i][far],
                                     _vocab.scale_rows(sc, far), out=own)
                own.masked_fill_(~kept[far], 0.0).mul_(a[i][far].unsqueeze(1))
            torch.mul(q, u, out=out)
            if far is not None:
                out[far] = (out[far].to(dtype) - own).to(out.dtype)
        if a is not None:
            exact = _target_entries(x_target, st, scale, a, b, masked)
            grad[at_target] = torch.where(owned, exact.to(grad.dtype), grad[at_target])
        return grad, None, None, None, None, None


def _target_entries(x_target, st, scale, a, b, masked) -> torch.Tensor:
    """The gradient at each row's own target, with 1 - p as -expm1(log p).

    a·(1 - p) computed as a - a·p loses all relative precision as p -> 1 (confident tokens); the
    chunk passes write that entry first, then this exact value replaces it.
    """
    u_target = _vocab.mul_scale(x_target - st[_M], scale) if _M in st else None
    log_p = u_target - st[_LOG_S] if u_target is not None else None
    log_p_kept = _vocab.mul_scale(x_target - st[_M_KEPT], scale) - st[_LOG_S_KEPT] if masked else log_p
    grad = a * -torch.expm1(log_p_kept)
    if b is not None:  # -b·p·(log p + H) = -b·p·(u - Ā)
        term = torch.where(torch.isneginf(log_p), 0.0, log_p.exp() * (u_target - st[_MEAN]))
        grad = grad - b * term
    return grad


def _check_inputs(
    logits, tokens, tp_group, temperature, chunk_size, keep_mask, vocab_size, inplace_backward
) -> tuple[_vocab.DeviceChecks, float | torch.Tensor]:
    """Raise TypeError/ValueError naming the argument; checks of tensor values come back deferred
    (read with the forward's one host sync). Returns them and the checked temperature."""
    _vocab.check_float_tensor(logits, "logits", "[T, V_local]")
    if logits.dim() != 2:
        raise ValueError(
            f"logits must be 2-D [T, V_local], got shape {tuple(logits.shape)}; flatten batch/sequence "
            f"dims first, e.g. logits.reshape(-1, logits.size(-1))"
        )
    n_rows, local_vocab = logits.shape
    _vocab.check_id_tensor(tokens, "tokens", "[T]")
    if tokens.shape != (n_rows,):
        raise ValueError(
            f"tokens must have shape [T] = ({n_rows},) to match logits {tuple(logits.shape)}, "
            f"got {tuple(tokens.shape)}"
        )
    if tokens.device != logits.device:
        raise ValueError(f"tokens are on {tokens.device} but logits on {logits.device}; move them together")
    _vocab.check_group(tp_group)
    if local_vocab == 0:
        raise ValueError("logits have no vocab columns (V_local = 0)")
    vocab = _vocab.global_vocab(local_vocab, tp_group, vocab_size)
    checks = _vocab.DeviceChecks()
    outside = (tokens < 0) | (tokens >= vocab)

    def tokens_error() -> ValueError:
        bad = torch.nonzero(outside).squeeze(1)[:8].tolist()
        return ValueError(
            f"tokens must be global ids in [0, {vocab}); rows {bad} are outside (e.g. {int(tokens[bad[0]])}); "
            f"mask padding targets with a valid id such as 0 and drop those rows from the loss"
        )

    checks.require(~outside, tokens_error)
    temperature = _vocab.check_temperature(temperature, (n_rows,), logits.device, checks, logits.dtype)
    _vocab.check_chunk_size(chunk_size)
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
        _vocab.check_inplace_target(logits)
    return checks, temperature


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
    checks, tau = _check_inputs(logits, tokens, tp_group, temperature, chunk_size, keep_mask, vocab_size,
                                inplace_backward)
    local_vocab = logits.size(1)
    n_valid = _vocab.valid_local_columns(local_vocab, vocab_size, tp_group)
    dtype = _vocab.compute_dtype(logits.dtype)
    spec = _Spec(
        group=tp_group,
        first_id=vocab_start(local_vocab, tp_group),
        n_valid=n_valid,
        chunk_rows=chunk_size or _vocab.default_chunk_rows(n_valid + 1, logits.device, dtype),
        with_entropy=bool(with_entropy),
        entropy_grad=bool(with_entropy and entropy_requires_grad),
        inplace_backward=bool(inplace_backward),
    )
    log_probs, entropy = _LogProbEntropy.apply(logits, tokens, keep_mask, tau, spec, checks)
    return log_probs, (entropy if with_entropy else None)
