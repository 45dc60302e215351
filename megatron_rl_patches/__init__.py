"""megatron-rl-patches: make Megatron-core fit RL post-training.

``megatron_rl_patches.apply()`` turns the patches on; set ``MEGATRON_RL_PATCHES=all`` to do it
with no code change. Importing this package is cheap: torch, megatron and wrapt load only when
a public name that needs them is first used.
"""
from __future__ import annotations

from megatron_rl_patches._lazy import lazy_getattr
from megatron_rl_patches.patching.startup.hook import warn_on_first_import

__version__ = "0.1.0"

# public name -> module that defines it (resolved on first access)
_LAZY = {
    "apply": "megatron_rl_patches.integrations",
    "revert": "megatron_rl_patches.integrations",
    "applied": "megatron_rl_patches.integrations",
    "PatchStatus": "megatron_rl_patches.patching.records",
    "reentrant_train": "megatron_rl_patches.reentrant",
    "accumulation_window": "megatron_rl_patches.windows",
    "build_inference_model": "megatron_rl_patches.inference",
    "build_inference_model_from_hf": "megatron_rl_patches.inference",
    "check_teacher_vocab": "megatron_rl_patches.inference",
    "load_inference_weights": "megatron_rl_patches.inference",
    "training_state_bytes": "megatron_rl_patches.inference",
    "on_device": "megatron_rl_patches.inference",
    "hold": "megatron_rl_patches.inference",
    "ResidencyBudget": "megatron_rl_patches.inference",
    "residency_report": "megatron_rl_patches.inference",
    "ResidencyReport": "megatron_rl_patches.inference",
    "score_layer_major": "megatron_rl_patches.inference",
    "log_probs_and_entropy": "megatron_rl_patches.ops.logprobs",
    "topk_ids": "megatron_rl_patches.ops.topk",
    "topk_logprobs": "megatron_rl_patches.ops.topk",
    "topk_opd_loss": "megatron_rl_patches.ops.topk",
    "topk_kl": "megatron_rl_patches.ops.topk",
    "union_ids": "megatron_rl_patches.ops.topk",
    "lm_head_log_probs_and_entropy": "megatron_rl_patches.ops.lm_head",
    "lm_head_topk_ids": "megatron_rl_patches.ops.lm_head",
    "lm_head_topk_logprobs": "megatron_rl_patches.ops.lm_head",
    "lm_head_divergence": "megatron_rl_patches.ops.divergence",
    "log_prob_output_processor": "megatron_rl_patches.processors.heads",
    "topk_output_processor": "megatron_rl_patches.processors.heads",
    "hidden_output_processor": "megatron_rl_patches.processors.distill",
    "divergence_output_processor": "megatron_rl_patches.processors.distill",
}

__all__ = sorted([*_LAZY, "__version__"])


__getattr__ = lazy_getattr(__name__, _LAZY, globals())

# MEGATRON_RL_PATCHES set where the start-up hook never ran (an editable install): say so once.
warn_on_first_import()
del warn_on_first_import


def __dir__() -> list[str]:
    return __all__
