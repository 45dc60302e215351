"""Megatron-LM (megatron.training, not in the megatron-core wheel): train() and its hook helpers."""
from megatron_rl_patches.integrations.train_reentry import train_reentry_patches

TRAINING = "megatron.training.training"

PATCHES = train_reentry_patches(TRAINING, ("forward_step_func", "model", "optimizer"), "Megatron-LM")
