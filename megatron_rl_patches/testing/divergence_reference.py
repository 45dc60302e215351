"""The one float64 reference of the divergence family, straight from the definitions in
probability space, for both routes: :func:`dense_divergence` (every model's [T, V] logits
materialized, plain autograd through log_softmax; also the baseline of `bench distill`) and
:func:`bucket_loss` (the top-k + tail buckets). Never used by the library."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["reference_divergence", "dense_divergence", "bucket_loss"]


def _kl(log_x: torch.Tensor, log_y: torch.Tensor) -> torch.Tensor:
    """Σ x·(log x − log y) over the last dim: 0·log 0 = 0, +inf where y = 0 < x; stand-ins keep
    the zero entries out of NaN gradients."""
    pos = log_x > -math.inf
    lx, ly = torch.where(pos, log_x, 0.0), torch.where(pos, log_y, 0.0)
    return torch.where(pos, lx.exp() * (lx - ly), 0.0).sum(dim=-1)


def _log_mix(log_x: torch.Tensor, log_y: torch.Tensor, w: float) -> torch.Tensor:
    """log(w·x + (1 − w)·y) in probability space (log of 1 standing in where the mixture is 0)."""
    m = w * log_x.exp() + (1 - w) * log_y.exp()
    return torch.where(m > 0, m, 1.0).log().masked_fill(m == 0, -math.inf)


def reference_divergence(name: str, log_p: torch.Tensor, log_q: torch.Tensor, beta: float = 0.5,
                         alpha: float = 0.1) -> torch.Tensor:
    """Per-row divergence of the student's distribution p from the teacher's q, both given as
    normalized log-probs over the last dim (-inf: probability 0)."""
    if name in ("jsd", "mixed_kl") and beta in (0.0, 1.0):
        name = "forward_kl" if beta == 0.0 else "reverse_kl"
    if name in ("skew_forward_kl", "skew_reverse_kl") and alpha == 0.0:
        name = name[len("skew_"):]
    if name == "forward_kl":
        return _kl(log_q, log_p)
    if name == "reverse_kl":
        return _kl(log_p, log_q)
    if name == "mixed_kl":
        return (1 - beta) * _kl(log_q, log_p) + beta * _kl(log_p, log_q)
    if name == "jsd":
        log_m = _log_mix(log_q, log_p, beta)
        return beta * _kl(log_q, log_m) + (1 - beta) * _kl(log_p, log_m)
    if name == "skew_forward_kl":
        return _kl(log_q, _log_mix(log_q, log_p, alpha))
    if name == "skew_reverse_kl":
        return _kl(log_p, _log_mix(log_p, log_q, alpha))
    if name == "tv":
        return 0.5 * (log_q.exp() - log_p.exp()).abs().sum(dim=-1)
    raise ValueError(f"unknown divergence {name!r}")


def _mixture(log_qs: Sequence[torch.Tensor], weights: Sequence[float] | None) -> torch.Tensor:
    """log Σ_j w_j·q_j with w normalized (None: uniform)."""
    n = len(log_qs)
    w = torch.tensor(list(weights) if weights is not None else [1.0] * n, dtype=torch.float64)
    w = w / w.sum()
    return torch.log(sum(wj * lq.exp() for wj, lq in zip(w.tolist(), log_qs)))


def dense_divergence(
    student_logits: torch.Tensor,
    teacher_logits: Sequence[torch.Tensor],
    *,
    divergence: str = "reverse_kl",
    beta: float = 0.5,
    alpha: float = 0.1,
    teacher_weights: Sequence[float] | None = None,
    temperature: float | torch.Tensor = 1.0,
    keep_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row divergence [T] of softmax(student/τ) from the teachers' mixture (probability space),
    each distribution restricted to the kept ids when `keep_mask` [T, V] is given."""
    tau = temperature[:, None] if isinstance(temperature, torch.Tensor) else temperature

    def log_probs(z: torch.Tensor) -> torch.Tensor:
        z = z / tau
        if keep_mask is not None:
            z = z.masked_fill(~keep_mask, -math.inf)
        return torch.log_softmax(z, dim=-1)

    log_q = _mixture([log_probs(z) for z in teacher_logits], teacher_weights)
    return reference_divergence(divergence, log_probs(student_logits), log_q, beta, alpha)


def bucket_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    teacher_tail: torch.Tensor | None,
    *,
    divergence: str = "reverse_kl",
    beta: float = 0.5,
    alpha: float = 0.1,
    teacher_weights: Sequence[float] | None = None,
    temperature: float | torch.Tensor = 1.0,
    renormalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [T], d loss.sum() / d logits) in float64 of the (k+1)-bucket divergence: the student's
    softmax at `ids` [T, k] plus its tail, against the teachers' [n, T, k] or [T, k] log-probs
    and tails (None: 1 − Σ q); `renormalize`: every model over its k ids, no tail."""
    x = logits.detach().double().requires_grad_(True)
    z = x / (temperature.double()[:, None] if isinstance(temperature, torch.Tensor) else temperature)
    p_ids = torch.softmax(z, dim=-1).gather(-1, ids)
    tq = teacher_logprobs.double()
    if tq.dim() == ids.dim():
        tq, teacher_tail = tq[None], None if teacher_tail is None else teacher_tail[None]
    if renormalize:
        log_p = (p_ids / p_ids.sum(-1, keepdim=True)).log()
        log_qs = [t - torch.logsumexp(t, dim=-1, keepdim=True) for t in tq]
    else:
        log_p = torch.cat([p_ids, (1 - p_ids.sum(-1))[..., None]], dim=-1).log()
        tails = (1 - tq.exp().sum(-1)).log() if teacher_tail is None else teacher_tail.double()
        log_qs = list(torch.cat([tq, tails[..., None]], dim=-1))
    loss = reference_divergence(divergence, log_p, _mixture(log_qs, teacher_weights), beta, alpha)
    loss.sum().backward()
    assert x.grad is not None
    return loss.detach(), x.grad
