"""The dense route of the full-vocabulary divergences: every model's [T, V] logits materialized and
plain autograd through log_softmax. The reference of the tests (in float64) and the baseline of
`bench distill`; never used by the library."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["dense_divergence"]


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
    n = len(teacher_logits)
    weights = list(teacher_weights) if teacher_weights is not None else [1.0 / n] * n

    def log_probs(z: torch.Tensor) -> torch.Tensor:
        z = z / tau
        if keep_mask is not None:
            z = z.masked_fill(~keep_mask, -math.inf)
        return torch.log_softmax(z, dim=-1)

    a = log_probs(student_logits)
    b = torch.logsumexp(torch.stack([log_probs(z) + math.log(w) if w > 0 else torch.full_like(a, -math.inf)
                                     for z, w in zip(teacher_logits, weights)]), dim=0)
    if keep_mask is not None:  # outside the kept ids: finite stand-ins, every term masked to 0 below
        a, b = a.masked_fill(~keep_mask, 0.0), b.masked_fill(~keep_mask, 0.0)
    kept = keep_mask if keep_mask is not None else torch.ones_like(a, dtype=torch.bool)
    p, q = a.exp() * kept, b.exp() * kept

    def mix(x: torch.Tensor, y: torch.Tensor, w: float) -> torch.Tensor:  # log(w·e^x + (1 − w)·e^y)
        return torch.logaddexp(x + math.log(w), y + math.log1p(-w))

    def kl(log_x: torch.Tensor, x: torch.Tensor, log_y: torch.Tensor) -> torch.Tensor:
        return (x * (log_x - log_y)).sum(dim=-1)

    if (divergence == "forward_kl" or (divergence == "jsd" and beta == 0.0)
            or (divergence == "skew_forward_kl" and alpha == 0.0)):
        return kl(b, q, a)
    if (divergence == "reverse_kl" or (divergence == "jsd" and beta == 1.0)
            or (divergence == "skew_reverse_kl" and alpha == 0.0)):
        return kl(a, p, b)
    if divergence == "jsd":
        m = mix(b, a, beta)
        return beta * kl(b, q, m) + (1 - beta) * kl(a, p, m)
    if divergence == "skew_forward_kl":
        return kl(b, q, mix(b, a, alpha))
    if divergence == "skew_reverse_kl":
        return kl(a, p, mix(a, b, alpha))
    if divergence == "tv":
        return 0.5 * (q - p).abs().sum(dim=-1)
    raise ValueError(f"unknown divergence {divergence!r}")
