"""megatron-rl-patches: make Megatron-core fit RL post-training.

``megatron_rl_patches.apply()`` turns the patches on; set ``MEGATRON_RL_PATCHES=all`` to do it
with no code change. Importing this package is cheap: torch, megatron and wrapt load only when
a public name that needs them is first used.
"""
from __future__ import annotations

from megatron_rl_patches._lazy import lazy_getattr, lazy_names
from megatron_rl_patches.patching.startup.hook import warn_on_first_import

__version__ = "0.1.0"

# module: the public names it defines (each resolved on first access)
_LAZY = lazy_names("""
    integrations: apply revert applied
    megatron_rl_patches.patching.records: PatchStatus
    reentrant: reentrant_train
    windows: accumulation_window
    inference: build_inference_model build_inference_model_from_hf check_teacher_vocab load_inference_weights
        training_state_bytes on_device hold ResidencyBudget residency_report ResidencyReport score_layer_major
    megatron_rl_patches.ops.logprobs: log_probs_and_entropy
    megatron_rl_patches.ops.topk: topk_ids topk_logprobs topk_opd_loss topk_kl union_ids
    megatron_rl_patches.ops.lm_head: lm_head_log_probs_and_entropy lm_head_topk_ids lm_head_topk_logprobs
    megatron_rl_patches.ops.divergence: lm_head_divergence
    megatron_rl_patches.ops.scoring_plan: ScoringPlan VOCAB
    megatron_rl_patches.processors.heads: log_prob_output_processor topk_output_processor
    megatron_rl_patches.processors.distill: hidden_output_processor divergence_output_processor
""")

__all__ = sorted([*_LAZY, "__version__"])


__getattr__ = lazy_getattr(__name__, _LAZY, globals())

# MEGATRON_RL_PATCHES set where the start-up hook never ran (an editable install): say so once.
warn_on_first_import()
del warn_on_first_import


def __dir__() -> list[str]:
    return __all__
