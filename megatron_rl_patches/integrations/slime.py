"""slime (and forks vendoring its module names): train re-entry, inference-only roles, log-probs.

slime ships no version metadata we can rely on, so these records carry no version range; the
parameter lists are the guard.
"""
from megatron_rl_patches.patching.registry import Patch

MODEL = "slime.backends.megatron_utils.model"
SLIME_TRAIN_PARAMS = ("rollout_id", "model", "optimizer", "opt_param_scheduler", "data_iterator")
SLIME_LOGPROB_PARAMS = ("logits", "tokens", "tp_group")

PATCHES = (
    Patch(
        name="train_reentry",
        target=f"{MODEL}:train",
        wrapper="megatron_rl_patches.reentrant:train_wrapper",
        description="slime train() callable once per rollout",
        requires=None,
        params=SLIME_TRAIN_PARAMS,
    ),
    Patch(
        name="train_reentry",
        target=f"{MODEL}:enable_forward_pre_hook",
        wrapper="megatron_rl_patches.reentrant:enable_hooks_helper_wrapper",
        description="slime enable_forward_pre_hook(model_chunks) idempotent",
        requires=None,
        params=("model_chunks",),
    ),
    Patch(
        name="train_reentry",
        target=f"{MODEL}:disable_forward_pre_hook",
        wrapper="megatron_rl_patches.reentrant:disable_hooks_helper_wrapper",
        description="slime disable_forward_pre_hook(model_chunks, param_sync) idempotent",
        requires=None,
        params=("model_chunks",),
    ),
    Patch(
        name="inference_roles",
        target=f"{MODEL}:initialize_model_and_optimizer",
        wrapper="megatron_rl_patches.inference:initialize_model_and_optimizer_wrapper",
        description="roles in MEGATRON_RL_PATCHES_INFERENCE_ROLES built inference-only",
        requires=None,
        params=("args", "role"),
    ),
    Patch(
        name="slime_logprobs",
        target="slime.utils.ppo_utils:calculate_log_probs_and_entropy",
        wrapper="megatron_rl_patches.integrations.slime:calculate_log_probs_and_entropy_wrapper",
        description="slime's log-prob/entropy replaced by the memory-optimal Function",
        requires=None,
        params=SLIME_LOGPROB_PARAMS,
    ),
    Patch(
        name="slime_logprobs",
        target="slime.backends.megatron_utils.loss:calculate_log_probs_and_entropy",
        wrapper="megatron_rl_patches.integrations.slime:calculate_log_probs_and_entropy_wrapper",
        description="the same, where slime's loss module bound the name at import",
        requires=None,
        params=SLIME_LOGPROB_PARAMS,
    ),
)
