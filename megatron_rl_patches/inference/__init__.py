"""Inference-only builds for frozen roles (teacher, reference, PRM teacher): model chunks with no
DDP wrapper, grad buffer or optimizer, weights-only loading, forward-only passes and the
training-state memory report (slime's `inference_roles` patch uses them:
`megatron_rl_patches.integrations.slime.roles`).

Names resolve lazily: `megatron-rl-patches memory` imports the memory report without torch.
"""
from __future__ import annotations

from megatron_rl_patches._lazy import lazy_getattr

_LAZY = {
    "build_inference_model": "build",
    "InferenceOnlyError": "guard",
    "assert_trainable": "guard",
    "is_inference_only": "guard",
    "load_inference_weights": "weights",
    "WeightsMismatchError": "load_errors",
    "CheckpointReadError": "load_errors",
    "inference_forward": "forward",
    "score_layer_major": "layer_major",
    "ActivationStats": "activation_store",
    "token_log_probs": "forward",
    "training_state_bytes": "memory",
    "TrainingStateBytes": "memory",
    "on_device": "residency",
    "hold": "residency",
    "residency_report": "residency_reporting",
    "ResidencyReport": "residency_reporting",
    "RESIDENCY_MODES": "residency",
    "release_streamed": "residency",
    "weights_on_host": "residency",
    "ResidencyBudget": "residency_budget",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted([*__all__, *globals()])
