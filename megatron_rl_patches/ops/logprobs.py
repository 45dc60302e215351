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

__all__ = ["log_probs_and_entropy"]

# rows of the per-token statistics (see _LogProbEntropy)
_STATS = (_M, _LOG_S, _MEAN, _M_KEPT, _LOG_S_KEPT) = (0, 1, 2, 3, 4)


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
        masked = keep_mask is not None
        scale = _vocab.row_scale(temperature, logits.size(0), _vocab.compute_dtype(logits.dtype))
        cols, owned = _vocab.local_columns(tokens, spec.first_id, spec.n_valid)
        stats_spec = _vocab.StatsSpec(spec.group, spec.n_valid, spec.chunk_rows, moment=spec.with_entropy,
                                      subset=masked, marked_in_subset_max=True)
        vocab = _vocab.vocab_stats(logits, cols.unsqueeze(1), owned.unsqueeze(1), scale, stats_spec, keep_mask)
        stats, log_probs, bad = _token_stats(vocab, scale, spec.with_entropy, masked)
        checks.require(bad == 0, lambda: _vocab.bad_rows_error(spec.op, spec.arg, bad))
        checks.raise_first()  # the forward's host sync: input checks and bad rows at once
        entropy = stats[_LOG_S] - stats[_MEAN] if spec.with_entropy else stats.new_empty(0)
        _save_for_backward(ctx, logits, torch.where(owned, cols, -1), stats, keep_mask, temperature, spec,
                           vocab.far_rows)
        if not spec.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    @_vocab.reject_double_backward
    def backward(ctx, grad_log_probs, grad_entropy):  # type: ignore[override]
        logits, target_cols, stats, keep_mask, temperature = ctx.saved_tensors
        spec: _vocab.OpSpec = ctx.spec
        grad_entropy = grad_entropy if spec.entropy_grad else None
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None
        n_rows = logits.size(0)
        dtype = _vocab.compute_dtype(logits.dtype)
        scale = _vocab.row_scale(temperature if ctx.tensor_temperature else ctx.temperature, n_rows, dtype)
        owned = target_cols >= 0
        at_target = (torch.arange(n_rows, device=logits.device), target_cols.clamp_min(0).long())
        token_stats = {index: stats[i] for index, i in ctx.stat_rows.items()}
        # read before the gradient (maybe the logits' own storage) is written; rows whose target
        # another rank owns read column 0 and are never used
        x_target = logits[at_target].to(dtype)
        grad = _gradient_buffer(logits, spec)
        # dL/dx = a·s·(onehot - p_kept) - b·s·p·(log p + H), a = dL/dlogp, b = dL/dH, s = 1/τ;
        # the chunk passes write every entry, the target entries are rewritten exactly below
        a = _vocab.mul_scale(grad_log_probs.to(dtype), scale) if grad_log_probs is not None else None
        b = _vocab.mul_scale(grad_entropy.to(dtype), scale) if grad_entropy is not None else None
        masked_a = keep_mask if ctx.masked else None
        if b is None:
            _log_prob_grad_pass(logits, grad, masked_a, token_stats, scale, a, spec)
        else:
            factors = _entropy_factors(token_stats, a, b, ctx.masked, ctx.kept_far_rows)
            _entropy_grad_pass(logits, grad, masked_a if a is not None else None, token_stats, scale, factors, spec)
        if a is not None:
            exact = _target_entries(x_target, token_stats, scale, a, b, ctx.masked)
            grad[at_target] = torch.where(owned, exact.to(grad.dtype), grad[at_target])
        return grad, None, None, None, None, None


# ----------------------------------------------------------------------------- forward steps


def _token_stats(
    vocab: _vocab.VocabStats, scale: float | torch.Tensor, with_entropy: bool, masked: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The [5, T] per-token statistics (rows _M ... _LOG_S_KEPT), the log-probs and the bad-row
    codes, from the combined vocab statistics (target logit summed apart)."""
    x_target = vocab.marked[:, 0]
    stats = torch.zeros((len(_STATS), x_target.size(0)), dtype=vocab.shift.dtype, device=vocab.shift.device)
    bad = _vocab.bad_row_codes(vocab.raw_max)
    stats[_M] = vocab.shift
    u_target = _vocab.mul_scale(x_target - vocab.shift, scale)
    # S = S_other + e^u_t; log p = u_t - log S stays exact as p -> 1 (log1p inside logaddexp)
    stats[_LOG_S] = torch.logaddexp(vocab.rest.log(), u_target)
    log_probs = u_target - stats[_LOG_S]
    if with_entropy:
        # Ā = E_p[u] (target term added back); H = log S - Ā. Saving Ā, not H, keeps
        # log p + H = u - Ā exact for near-uniform rows in backward.
        p_target = log_probs.exp()
        stats[_MEAN] = vocab.moment * stats[_LOG_S].neg().exp() + torch.where(p_target > 0, p_target * u_target, 0.0)
    if masked:
        stats[_M_KEPT] = vocab.subset_shift
        u_kept = _vocab.mul_scale(x_target - vocab.subset_shift, scale)
        stats[_LOG_S_KEPT] = torch.logaddexp(vocab.subset_sum.log(), u_kept)
        log_probs = u_kept - stats[_LOG_S_KEPT]
        bad = torch.where((bad == 0) & torch.isneginf(stats[_LOG_S_KEPT]), _vocab.BAD_KEPT_NEG_INF, bad)
    return stats, log_probs, bad


def _save_for_backward(ctx, logits, target_cols, stats, keep_mask, temperature, spec, kept_far_rows) -> None:
    """Keep the logits and only the statistics rows backward reads (<= 24 B/token in all)."""
    masked = keep_mask is not None
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
    ctx.kept_far_rows = kept_far_rows  # rows whose kept ids have their own shift (host list)
    ctx.tensor_temperature = isinstance(temperature, torch.Tensor)
    ctx.temperature = None if ctx.tensor_temperature else temperature
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(
        logits,
        target_cols.to(torch.int32),  # int32 local target column (-1: another rank owns it), not int64 ids
        stats[needed].contiguous(),  # the [5, T] scratch itself is freed
        keep_mask,
        temperature if ctx.tensor_temperature else None,
    )


# ----------------------------------------------------------------------------- backward steps


def _gradient_buffer(logits: torch.Tensor, spec: _vocab.OpSpec) -> torch.Tensor:
    """Where the gradient goes: the logits' own storage with `inplace_backward`, else a fresh
    tensor; padded columns (ids >= vocab_size) get 0."""
    if spec.inplace_backward:
        # the caller allowed us to overwrite the logits: bump their version so any other
        # node that saved them fails autograd's check instead of reading the gradient
        torch.autograd.graph.increment_version(logits)
        grad = logits.detach()
    else:
        grad = torch.empty_like(logits)
    if spec.n_valid < logits.size(1):
        grad[:, spec.n_valid :].zero_()
    return grad


def _log_prob_grad_pass(logits, grad, keep_mask, token_stats, scale, a, spec: _vocab.OpSpec) -> None:
    """Without an entropy gradient: every entry gets -a·p (-a·p_kept on the kept ids, 0 on the
    others), i.e. -(a/S)·e^u, or -a·e^(u_kept - log S_kept) when masked."""
    masked = keep_mask is not None
    shift = token_stats[_M_KEPT] if masked else token_stats[_M]
    row_mul = -a if masked else -a * token_stats[_LOG_S].neg().exp()
    n_rows, n_valid = logits.size(0), spec.n_valid
    probs_buf = torch.empty((min(spec.chunk_rows, n_rows), n_valid), dtype=shift.dtype, device=logits.device)
    for start, stop in _vocab.row_chunks(n_rows, spec.chunk_rows):
        rows = slice(start, stop)
        probs = probs_buf[: stop - start]
        _vocab.shifted_rows(logits[rows, :n_valid], shift[rows], _vocab.scale_rows(scale, rows), out=probs)
        if masked:
            probs.sub_(token_stats[_LOG_S_KEPT][rows].unsqueeze(1)).exp_().masked_fill_(~keep_mask[rows, :n_valid], 0.0)
        else:
            probs.exp_()
        torch.mul(probs, row_mul[rows].unsqueeze(1), out=grad[rows, :n_valid])


@dataclass
class _EntropyFactors:
    """Per-row factors of the entropy-gradient pass: every entry gets
    e^u·(row_mul·u + row_add), minus a·p_kept on the kept ids (kept_coef·e^u where the kept ids
    share the full shift; a second exp with their own shift on `far_rows`)."""

    row_mul: torch.Tensor
    row_add: torch.Tensor
    a: torch.Tensor | None
    kept_coef: torch.Tensor | None
    far_rows: list[int]


def _entropy_factors(token_stats, a, b, masked: bool, kept_far_rows: list[int]) -> _EntropyFactors:
    """p·(-b·(u - Ā) - a·p_kept/p) = e^u·(row_mul·u + row_add [- a·e^(-log S_kept) on kept ids])."""
    inv_s = token_stats[_LOG_S].neg().exp()
    row_mul = -b * inv_s
    row_add = b * token_stats[_MEAN] * inv_s
    kept_coef, far_rows = None, []
    if a is not None and not masked:
        row_add = row_add - a * inv_s
    if a is not None and masked:
        same = token_stats[_M_KEPT] == token_stats[_M]  # kept ids share the full shift: p_kept = e^u·e^(-log S_kept)
        limit = _vocab.SHARED_SHIFT_LIMIT
        kept_coef = torch.where(same, a * token_stats[_LOG_S_KEPT].clamp_min(-limit).neg().exp(), 0.0)
        far_rows = kept_far_rows  # the other rows: their kept ids get their own exp
    return _EntropyFactors(row_mul, row_add, a, kept_coef, far_rows)


def _entropy_grad_pass(logits, grad, keep_mask, token_stats, scale, factors: _EntropyFactors,
                       spec: _vocab.OpSpec) -> None:
    """With an entropy gradient, chunk by chunk; `keep_mask` only when masked and the log-prob
    has a gradient too."""
    n_rows, n_valid = logits.size(0), spec.n_valid
    dtype, device = factors.row_mul.dtype, logits.device
    width = min(spec.chunk_rows, n_rows)
    shifted_buf = torch.empty((width, n_valid), dtype=dtype, device=device)
    exps_buf = torch.empty((width, n_valid), dtype=dtype, device=device)
    own_buf = torch.empty((width, n_valid), dtype=dtype, device=device) if factors.far_rows else None
    for start, stop in _vocab.row_chunks(n_rows, spec.chunk_rows):
        rows = slice(start, stop)
        chunk = logits[rows, :n_valid]
        chunk_scale = _vocab.scale_rows(scale, rows)
        shifted, exps = shifted_buf[: stop - start], exps_buf[: stop - start]
        _vocab.shifted_rows(chunk, token_stats[_M][rows], chunk_scale, out=shifted)
        torch.exp(shifted, out=exps)
        shifted.clamp_min_(_vocab.NEG_FLOOR)  # exps = 0 there: keep exps·u at 0, not 0·inf = NaN
        shifted.mul_(factors.row_mul[rows].unsqueeze(1)).add_(factors.row_add[rows].unsqueeze(1))
        kept = keep_mask[rows, :n_valid] if keep_mask is not None else None
        far = None
        if kept is not None:
            shifted.sub_(kept * factors.kept_coef[rows].unsqueeze(1))
            far = _vocab.rows_in_chunk(factors.far_rows, start, stop, device)
        if far is not None:  # computed before the gradient (maybe the logits themselves) is written
            own = own_buf[: stop - start if isinstance(far, slice) else far.numel()]
            _far_kept_term(chunk[far], kept[far], token_stats, rows, far, chunk_scale, factors.a, out=own)
        out = grad[rows, :n_valid]
        torch.mul(exps, shifted, out=out)
        if far is not None:
            out[far] = (out[far].to(dtype) - own).to(out.dtype)


def _far_kept_term(chunk, kept, token_stats, rows: slice, far, chunk_scale, a, out: torch.Tensor) -> None:
    """a·p_kept on the kept ids of the rows whose kept ids have their own shift (a second exp)."""
    _vocab.own_shift_exp(chunk, token_stats[_M_KEPT][rows][far], token_stats[_LOG_S_KEPT][rows][far],
                         _vocab.scale_rows(chunk_scale, far), out=out)
    out.masked_fill_(~kept, 0.0).mul_(a[rows][far].unsqueeze(1))


def _target_entries(x_target, token_stats, scale, a, b, masked) -> torch.Tensor:
    """The gradient at each row's own target, with 1 - p as -expm1(log p).

    a·(1 - p) computed as a - a·p loses all relative precision as p -> 1 (confident tokens); the
    chunk passes write that entry first, then this exact value replaces it.
    """
    u_target = _vocab.mul_scale(x_target - token_stats[_M], scale) if _M in token_stats else None
    log_p = u_target - token_stats[_LOG_S] if u_target is not None else None
    if masked:
        log_p_kept = _vocab.mul_scale(x_target - token_stats[_M_KEPT], scale) - token_stats[_LOG_S_KEPT]
    else:
        log_p_kept = log_p
    grad = a * -torch.expm1(log_p_kept)
    if b is not None:  # -b·p·(log p + H) = -b·p·(u - Ā)
        term = torch.where(torch.isneginf(log_p), 0.0, log_p.exp() * (u_target - token_stats[_MEAN]))
        grad = grad - b * term
    return grad


# ----------------------------------------------------------------------------- validation


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
    _vocab.check_tokens_shape(tokens, n_rows, logits.device, f"to match logits {tuple(logits.shape)}", "logits")
    _vocab.check_group(tp_group)
    if local_vocab == 0:
        raise ValueError("logits have no vocab columns (V_local = 0)")
    vocab = _vocab.global_vocab(local_vocab, tp_group, vocab_size)
    checks = _vocab.DeviceChecks()
    _vocab.require_tokens_in_vocab(tokens, vocab, checks)
    temperature = _vocab.check_temperature(temperature, (n_rows,), logits.device, checks, logits.dtype)
    _vocab.check_chunk_size(chunk_size)
    _vocab.check_keep_mask(keep_mask, logits.shape, logits.device, "the logits")
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
    spec = _vocab.op_spec(
        local_vocab, tp_group, vocab_size,
        _vocab.logits_chunk_rows(chunk_size, local_vocab, tp_group, vocab_size, logits),
        "log_probs_and_entropy",
        with_entropy=bool(with_entropy),
        entropy_grad=bool(with_entropy and entropy_requires_grad),
        inplace_backward=bool(inplace_backward),
    )
    log_probs, entropy = _LogProbEntropy.apply(logits, tokens, keep_mask, tau, spec, checks)
    return log_probs, (entropy if with_entropy else None)
