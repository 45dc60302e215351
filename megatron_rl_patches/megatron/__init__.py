"""Output processors for megatron-core's GPTModel (`output_processor=`), on every supported
version (patch `gpt_output_processor` backports the keyword to releases before 0.18)."""
from __future__ import annotations

from megatron_rl_patches._lazy import lazy_getattr

_LAZY = {
    "log_prob_output_processor": "megatron_rl_patches.megatron.processors",
    "topk_output_processor": "megatron_rl_patches.megatron.processors",
    "hidden_output_processor": "megatron_rl_patches.megatron.distill",
    "divergence_output_processor": "megatron_rl_patches.megatron.distill",
}
__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY, globals())
