"""Full-vocabulary OPD's loss in slime (MEGATRON_RL_PATCHES_OPD_K=vocab): the chosen divergence
between the student and the teachers' mixture over the whole vocabulary, which the fused training
step computes beside slime's log-probs from the teachers' hidden states and heads
(`integrations.megatron.opd.hidden_teachers`, `fused_context.vocab_processor`: tile by tile, no
[T, V] tensor), per sample in slime's zigzag rows, averaged by slime's `sum_of_sample_mean`."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd.fused_context import DIVERGENCE
from megatron_rl_patches.integrations.slime.topk import allgather_cp_active, sample_rows


def vocab_opd_loss(args: Any, batch: dict, logits: Any, sum_of_sample_mean: Any, settings: Any) -> tuple[Any, dict]:
    """slime's custom loss under K=vocab: POLICY_WEIGHT · slime's policy loss + COEF · the
    full-vocabulary divergence (per token, averaged per sample by `sum_of_sample_mean`), logged as
    "opd_vocab_loss"."""
    from slime.backends.megatron_utils.loss import policy_loss_function  # lazy: optional dependency slime

    if not isinstance(logits, dict) or DIVERGENCE not in logits:
        raise RuntimeError("slime_opd: MEGATRON_RL_PATCHES_OPD_K=vocab needs the fused training step (slime_fused) "
                           "with the full-vocabulary request; this step ran without it")
    loss, log = policy_loss_function(args, batch, logits, sum_of_sample_mean)
    pieces = sample_rows(logits[DIVERGENCE], batch, allgather_cp_active(args))  # masks: slime's zigzag rows
    opd = sum_of_sample_mean(torch.cat(pieces))
    log["opd_vocab_loss"] = opd.clone().detach()
    return settings.policy_weight * loss + settings.coef * opd, log
