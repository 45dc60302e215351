"""Inference-only builds for frozen roles (teacher, reference, PRM teacher): model chunks with no
DDP wrapper, grad buffer or optimizer, weights-only loading, forward-only passes and the
training-state memory report (slime's `inference_roles` patch uses them:
`megatron_rl_patches.integrations.slime.roles`).

Rooms by concept: `residency/` (where the weights live between uses), `loading/` (weights-only
reads), `layer_major/` (layer-major scoring), `sizing/` (memory formulas, torch-free); `build`,
`forward` and `guard` tie them together. Names resolve lazily: `megatron-rl-patches memory`
imports the memory report without torch.
"""
from __future__ import annotations

from megatron_rl_patches import _aliases
from megatron_rl_patches._lazy import lazy_getattr, lazy_names

_LAZY = lazy_names("""
    build: build_inference_model
    build_hf: build_inference_model_from_hf
    megatron_rl_patches.inference.loading.hf.vocab: check_teacher_vocab
    guard: InferenceOnlyError assert_trainable is_inference_only
    megatron_rl_patches.inference.loading.weights: load_inference_weights
    megatron_rl_patches.inference.loading.errors: WeightsMismatchError CheckpointReadError
    forward: inference_forward token_log_probs
    megatron_rl_patches.inference.layer_major.scoring: score_layer_major
    megatron_rl_patches.inference.layer_major.activation_store: ActivationStats
    megatron_rl_patches.inference.sizing.memory: training_state_bytes TrainingStateBytes
    megatron_rl_patches.inference.residency.placement: on_device hold release_streamed weights_on_host
    megatron_rl_patches.inference.residency.modes: RESIDENCY_MODES
    megatron_rl_patches.inference.residency.reporting: residency_report ResidencyReport
    megatron_rl_patches.inference.residency.budget: ResidencyBudget
    megatron_rl_patches.inference.teacher_layout.layout: TeacherLayout
    megatron_rl_patches.inference.teacher_layout.scoring: score_at_layout topk_at_layout hidden_at_layout
        select_topk_at_layout output_weight_at_layout
    megatron_rl_patches.inference.teacher_layout.groups: teacher_groups
""")

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted([*__all__, *globals()])


# Module paths from before the rooms by concept (`inference.residency` and `inference.layer_major`
# are the packages now and keep their public names).
_aliases.install(__name__, {
    "activation_store": "megatron_rl_patches.inference.layer_major.activation_store",
    "chunks": "megatron_rl_patches.model.chunks",  # what every room knows of a model: the `model/` room
    "decoder_steps": "megatron_rl_patches.inference.layer_major.decoder_steps",
    "dist_weights": "megatron_rl_patches.inference.loading.torch_dist",
    "host_init": "megatron_rl_patches.inference.residency.host_init",
    "load_errors": "megatron_rl_patches.inference.loading.errors",
    "memory": "megatron_rl_patches.inference.sizing.memory",
    "paths": "megatron_rl_patches.inference.loading.paths",
    "residency_budget": "megatron_rl_patches.inference.residency.budget",
    "residency_plan": "megatron_rl_patches.inference.sizing.residency_plan",
    "residency_reporting": "megatron_rl_patches.inference.residency.reporting",
    "residency_storage": "megatron_rl_patches.inference.residency.storage",
    "residency_units": "megatron_rl_patches.inference.residency.units",
    "weights": "megatron_rl_patches.inference.loading.weights",
})
