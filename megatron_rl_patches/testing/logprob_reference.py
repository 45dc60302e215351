"""The one float64 reference of the per-token log-prob and entropy: plain autograd through
log_softmax over materialized [T, V] logits, for the tests of every route (logits, fused head,
registered backends). Never used by the library."""
from __future__ import annotations

import math

import torch

__all__ = ["reference_log_probs", "scaled_logits", "kept_ids"]


def scaled_logits(logits: torch.Tensor, temperature: float | torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """float64 logits / temperature (a float or per row [T]), columns >= `vocab_size` dropped."""
    z = logits.double()
    z = z / (temperature.double().reshape(-1, 1) if isinstance(temperature, torch.Tensor) else temperature)
    return z if vocab_size is None else z[:, :vocab_size]


def kept_ids(keep_mask: torch.Tensor, tokens: torch.Tensor, n_cols: int) -> torch.Tensor:
    """`keep_mask`'s first `n_cols` columns with every row's target kept."""
    kept = keep_mask[:, :n_cols].clone()
    kept[torch.arange(tokens.numel()), tokens] = True
    return kept


def reference_log_probs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float | torch.Tensor = 1.0,
                        keep_mask: torch.Tensor | None = None,
                        vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (log p(target) over the kept ids (the target always kept), entropy over the full
    distribution) per row of softmax(logits / temperature), columns >= `vocab_size` dropped;
    differentiable in `logits` (pass float64 logits that require grad for reference gradients)."""
    z = scaled_logits(logits, temperature, vocab_size)
    logp_all = torch.log_softmax(z, dim=-1)
    p = logp_all.exp()
    entropy = -torch.where(p > 0, p * logp_all, 0.0).sum(-1)
    if keep_mask is not None:
        z = z.masked_fill(~kept_ids(keep_mask, tokens, z.size(1)), -math.inf)
        logp_all = torch.log_softmax(z, dim=-1)
    return logp_all.gather(1, tokens.long().unsqueeze(1)).squeeze(1), entropy
