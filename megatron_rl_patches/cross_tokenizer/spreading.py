"""The teacher's chunk log-probs spread over the student's tokens: each student token i of chunk
j gets log pS(y_i) + (ℓT_j − ℓS_j)/|S_j|, so a 1:1 chunk gives the teacher's token log-prob and
every chunk sums to ℓT_j exactly; a sequence's sum of `value − log pS` is the sampled reverse-KL
estimate (with the sign of log pT − log pS)."""
from __future__ import annotations

import torch

from megatron_rl_patches.cross_tokenizer.alignment import Alignment

__all__ = ["chunk_sums", "spread_chunk_log_probs"]


def _check(values: object, chunk: torch.Tensor, name: str, side: str) -> torch.Tensor:
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor of per-token log-probs, got {type(values).__name__}")
    if values.dim() != 1 or values.numel() != chunk.numel():
        raise ValueError(f"{name} must be 1-D with one value per {side} token ({chunk.numel()}, as the alignment), "
                         f"got shape {tuple(values.shape)}; pass one sample's log-probs")
    return values


def chunk_sums(values: torch.Tensor, chunk: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """Σ of `values` per chunk, float64 [n_chunks] (tokens of chunk −1 left out)."""
    chunk = chunk.to(values.device)
    kept = chunk >= 0
    sums = torch.zeros(n_chunks, dtype=torch.float64, device=values.device)
    return sums.index_add(0, chunk[kept], values[kept].to(torch.float64))


def spread_chunk_log_probs(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                           alignment: Alignment) -> torch.Tensor:
    """Per student token [n_student] (the student's dtype, no gradient): log pS(y_i) +
    (ℓT_j − ℓS_j)/|S_j| for token i of chunk j (exactly ℓT_j when the chunk has one student
    token); a token of chunk −1 gets its own log pS (log-ratio 0: it adds nothing). Not
    log-probabilities (a value can be > 0); consumers use `value − log pS(y_i)`."""
    s = _check(student_log_probs, alignment.student_chunk, "student_log_probs", "student").detach()
    t = _check(teacher_log_probs, alignment.teacher_chunk, "teacher_log_probs", "teacher").detach()
    if t.device != s.device:
        raise ValueError(f"teacher_log_probs ({t.device}) and student_log_probs ({s.device}) must be on one device")
    chunk = alignment.student_chunk.to(s.device)
    n = alignment.n_chunks
    ls, lt = chunk_sums(s, chunk, n), chunk_sums(t, alignment.teacher_chunk, n)
    size = torch.bincount(chunk[chunk >= 0], minlength=n).to(torch.float64)
    j = chunk.clamp(min=0)
    own = s.to(torch.float64)
    spread = torch.where(size[j] == 1, lt[j], own + (lt[j] - ls[j]) / size[j].clamp(min=1))
    return torch.where(chunk >= 0, spread, own).to(s.dtype)
