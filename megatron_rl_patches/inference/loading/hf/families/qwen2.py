"""Qwen2 / Qwen2.5 (`model_type` qwen2): Llama's layer with q/k/v biases (always: transformers'
Qwen2 reads no `attention_bias`), no q/k norm; sliding-window attention is refused."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture, decoder_architecture
from megatron_rl_patches.inference.loading.hf.families.common import dense_layer_params, dense_layer_tensors
from megatron_rl_patches.inference.loading.hf.families.family import Family
from megatron_rl_patches.inference.loading.hf.families.fields import SLIDING


def read(config: dict[str, Any], source: str) -> HFArchitecture:
    return decoder_architecture(config, source, qkv_bias=True, qk_norm=False, moe=False)


FAMILY = Family(
    name="qwen2", hf_class="Qwen2", read=read, layer_tensors=dense_layer_tensors, layer_params=dense_layer_params,
    mbridge=True, tiny_fields={"head_dim": None},  # Qwen2's config derives head_dim from the hidden size
    fields=SLIDING,  # q/k/v biases always: transformers' Qwen2 reads no attention_bias
)
