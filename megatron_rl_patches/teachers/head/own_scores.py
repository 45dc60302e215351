"""A teacher's own scores from its final hidden states and output layer (`own_scores`): per row the
actual token's log-prob, the teacher's own top-k ids with their log-probs, and the exact tail (the
log of the mass outside them), in one top-k pass and one log-prob pass of the fused head's ops over
the vocabulary tiles (no [R, V] logits on any rank). The one computation of both teachers that hold
hidden states: the live self-teacher (`SelfTeacher`: the student's weights) and a served teacher's
states through its head on the trainer (`TeacherHead.own_scores`)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.ops.lm_head import lm_head_topk_ids, lm_head_topk_logprobs


def own_scores(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, k: int, *, temperature: Any,
               tp_group: Any = None, vocab_size: int | None = None, invariant: bool | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the token's log-prob [R], the top-`k` ids [R, k], their log-probs [R, k], the tail [R]) of
    hidden [R, H] through weight [V_local, H] at `temperature` (float64 but the int64 ids): the
    actual token is scored beside the top-k in the same pass (its slot masked out where it is one of
    them: the op's tail is then the top-k's; else the top-k's tail is the rest's plus the token's).
    Every rank of `tp_group` calls it with the same rows (the ops combine the vocabulary shards).
    `invariant`: both passes' mode, the plan's (None: the setting MEGATRON_RL_PATCHES_INVARIANT)."""
    options: dict[str, Any] = dict(tp_group=tp_group, temperature=temperature, vocab_size=vocab_size,
                                   invariant=invariant)
    vocab = vocab_size if vocab_size is not None else weight.shape[0] * (1 if tp_group is None else
                                                                       dist.get_world_size(tp_group))
    with torch.no_grad():
        ids = lm_head_topk_ids(hidden, weight, k, **options)
        among = ids == tokens[:, None]
        repeated = among.any(dim=1)
        if k + 1 >= vocab:  # K = V - 1: the one id outside the top-k is the tail, the token where it is not among them
            values, tail = (part.double() for part in lm_head_topk_logprobs(hidden, weight, ids, **options))
            token = torch.where(repeated, values.gather(1, among.int().argmax(dim=1, keepdim=True))[:, 0], tail)
            return token, ids.long(), values, tail
        asked = torch.cat([ids, tokens[:, None]], dim=1)
        mask = torch.cat([torch.ones_like(ids, dtype=torch.bool), ~repeated[:, None]], dim=1)
        scored, rest = lm_head_topk_logprobs(hidden, weight, asked, ids_mask=mask, **options)
    values = scored[:, :k].double()
    own = scored[:, k].double()
    token = torch.where(repeated, values.gather(1, among.int().argmax(dim=1, keepdim=True))[:, 0], own)
    tail = torch.where(repeated, rest.double(), torch.logaddexp(rest.double(), own))
    return token, ids.long(), values, tail
