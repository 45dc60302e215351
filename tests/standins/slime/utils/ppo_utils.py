"""Stand-in for slime.utils.ppo_utils: calculate_log_probs_and_entropy with slime's signature,
returning a marker so a test sees whose function ran."""
from __future__ import annotations

SLIMES_OWN = "slime's own"


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    return SLIMES_OWN
