"""Stand-in for slime's loss module: like slime's, it binds calculate_log_probs_and_entropy from
ppo_utils at import (why patch `slime_logprobs` targets this module too)."""
from slime.utils.ppo_utils import calculate_log_probs_and_entropy  # noqa: F401


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths, with_entropy=False,
                              non_loss_data=True, top_p_token_ids=None, top_p_token_offsets=None):
    """slime's signature (624b824a); its behaviour is tested on slime's real source (the slime lane)."""
    raise LookupError("get_log_probs_and_entropy: run the slime lane for slime's own")
