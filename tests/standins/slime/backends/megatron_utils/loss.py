"""Stand-in for slime's loss module: like slime's, it binds calculate_log_probs_and_entropy from
ppo_utils at import (why patch `slime_logprobs` targets this module too)."""
from slime.utils.ppo_utils import calculate_log_probs_and_entropy  # noqa: F401
