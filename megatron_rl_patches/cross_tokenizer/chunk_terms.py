"""The per-token distillation terms of one teacher with another tokenizer, given the teacher's
values already brought back to the student's rows (`teacher_passes`): the (k+1)-bucket divergence
at chunk starts and the token-level reverse-KL term. A training loop that scores the teacher itself
(slime's top-k OPD, verl, a hand-written loop) computes its loss with these."""
from __future__ import annotations

import torch

from megatron_rl_patches.cross_tokenizer.losses import bucket_log_probs
from megatron_rl_patches.ops.topk import topk_kl


def masked_tail(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(1 − Σ p) over the masked-in ids of each row (a part of the ids a step scored)."""
    mass = torch.where(mask, log_probs.exp(), 0.0).sum(-1)
    return torch.log1p(-mass.clamp(max=1.0 - 1e-7))


def chunk_distillation_terms(student_id_log_probs: torch.Tensor, ids_mask: torch.Tensor,
                             student_tail: torch.Tensor, teacher_log_probs: torch.Tensor,
                             teacher_tail: torch.Tensor, alive: torch.Tensor, log_ratio: torch.Tensor,
                             token_log_probs: torch.Tensor, divergence: str = "reverse_kl",
                             invariant: bool | None = None) -> torch.Tensor:
    """Per student token [N]: the divergence (`topk_kl`'s name) between the student's buckets (its
    log-probs of each bucket's ids [N, k·D] with their mask, grouped; its tail [N]) and the
    teacher's (log P(bucket) [N, k] and tail [N]) where `alive` [N, k] marks live buckets (chunk
    starts), plus the token-level term −r with gradient −r·∇log pS(y) from the teacher's
    `log_ratio` [N] (`log_ratio` of `teacher_passes`) and the student's `token_log_probs` [N].
    `invariant` as `topk_kl`'s."""
    buckets = bucket_log_probs(student_id_log_probs, ids_mask, alive)
    value = topk_kl(buckets, student_tail, teacher_log_probs, teacher_tail, divergence=divergence, ids_mask=alive,
                    invariant=invariant)
    r = -log_ratio
    token = r + r * (token_log_probs - token_log_probs.detach())
    return value.to(token_log_probs) + token
