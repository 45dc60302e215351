"""Megatron-LM (megatron.training, not in the megatron-core wheel): train() and its hook helpers."""
from megatron_rl_patches.patching.registry import Patch

TRAINING = "megatron.training.training"

PATCHES = (
    Patch(
        name="train_reentry",
        target=f"{TRAINING}:train",
        wrapper="megatron_rl_patches.reentrant:train_wrapper",
        description="Megatron-LM train() callable once per rollout",
        requires=None,
        params=("forward_step_func", "model", "optimizer"),
    ),
    Patch(
        name="train_reentry",
        target=f"{TRAINING}:enable_forward_pre_hook",
        wrapper="megatron_rl_patches.reentrant:enable_hooks_helper_wrapper",
        description="Megatron-LM enable_forward_pre_hook(model_chunks) idempotent",
        requires=None,
        params=("model_chunks",),
    ),
    Patch(
        name="train_reentry",
        target=f"{TRAINING}:disable_forward_pre_hook",
        wrapper="megatron_rl_patches.reentrant:disable_hooks_helper_wrapper",
        description="Megatron-LM disable_forward_pre_hook(model_chunks, param_sync) idempotent",
        requires=None,
        params=("model_chunks",),
    ),
)
