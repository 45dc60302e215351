"""Teachers from Hugging Face checkpoints: config.json -> a Megatron local-spec build, safetensors
-> its weights (the package's own converter; no pickle read, no network, transformers not needed).

Names resolve lazily: the memory planner reads config.json without torch."""
from __future__ import annotations

from megatron_rl_patches import _aliases
from megatron_rl_patches._lazy import lazy_getattr, lazy_names

_LAZY = lazy_names("""
    megatron_rl_patches.inference.build_hf: build_inference_model_from_hf hf_vocab_size
    vocab: check_teacher_vocab
    checkpoint_config: read_checkpoint_config CheckpointConfig
    families: read_architecture
    architecture: HFArchitecture UnsupportedCheckpointError
    memory_plan: hf_memory_plan
""")

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted([*__all__, *globals()])


# the memory plan's module was `plan` (one name per concept: "plan" alone named four things)
_aliases.install(__name__, {"plan": "megatron_rl_patches.inference.loading.hf.memory_plan"})
