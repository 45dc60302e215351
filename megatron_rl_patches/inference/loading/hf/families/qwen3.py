"""Qwen3 (`model_type` qwen3): per-head RMSNorm of queries and keys before RoPE (Megatron's
q_layernorm / k_layernorm), no q/k/v biases unless `attention_bias`, a SwiGLU MLP in every layer."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture, decoder_architecture
from megatron_rl_patches.inference.loading.hf.families.common import dense_layer_params, dense_layer_tensors
from megatron_rl_patches.inference.loading.hf.families.family import Family
from megatron_rl_patches.inference.loading.hf.families.fields import SLIDING


def read(config: dict[str, Any], source: str) -> HFArchitecture:
    return decoder_architecture(config, source, qkv_bias=False, qk_norm=True, moe=False)


FAMILY = Family(
    name="qwen3", hf_class="Qwen3", read=read, layer_tensors=dense_layer_tensors, layer_params=dense_layer_params,
    mbridge=True, fields=SLIDING | {"attention_bias"},
)
