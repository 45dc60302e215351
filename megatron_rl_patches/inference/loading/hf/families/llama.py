"""Llama (`model_type` llama): q/k/v without biases unless `attention_bias`, no q/k norm, a SwiGLU
MLP in every layer, plain RoPE (RoPE scaling is refused by the common reader)."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture, decoder_architecture
from megatron_rl_patches.inference.loading.hf.families.common import dense_layer_params, dense_layer_tensors
from megatron_rl_patches.inference.loading.hf.families.family import Family


def read(config: dict[str, Any], source: str) -> HFArchitecture:
    return decoder_architecture(config, source, qkv_bias=False, qk_norm=False, moe=False)


FAMILY = Family(
    name="llama", hf_class="Llama", read=read, layer_tensors=dense_layer_tensors, layer_params=dense_layer_params,
    mbridge=True, fields=frozenset({"attention_bias", "mlp_bias"}),
)
