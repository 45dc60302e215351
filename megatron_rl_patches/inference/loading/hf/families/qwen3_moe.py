"""Qwen3-MoE (`model_type` qwen3_moe): Qwen3's attention and, in every layer, a softmax router over
SwiGLU experts (top `num_experts_per_tok`, renormalized when `norm_topk_prob`); configs with dense
layers among the MoE ones (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture, decoder_architecture
from megatron_rl_patches.inference.loading.hf.families.common import (
    attention_params,
    attention_tensors,
    moe_config,
    moe_params,
    moe_tensors,
)
from megatron_rl_patches.inference.loading.hf.families.family import Family, Param, Shape
from megatron_rl_patches.inference.loading.hf.families.fields import ROUTED


def sparse_step_problems(config: dict[str, Any]) -> list[str]:
    """Dense layers among the MoE ones (the Qwen MoE configs' way of writing them): not mapped."""
    refused = []
    if config.get("mlp_only_layers"):
        refused.append(f"mlp_only_layers={config['mlp_only_layers']!r} (every layer must be MoE)")
    if config.get("decoder_sparse_step", 1) != 1:
        refused.append(f"decoder_sparse_step={config['decoder_sparse_step']!r} (every layer must be MoE)")
    return refused


def read(config: dict[str, Any], source: str) -> HFArchitecture:
    return decoder_architecture(config, source, qkv_bias=False, qk_norm=True, moe=True,
                                refused=sparse_step_problems(config))


def layer_tensors(arch: HFArchitecture, layer: int) -> dict[str, Shape]:
    return {**attention_tensors(arch), **moe_tensors(arch)}


def layer_params(arch: HFArchitecture, layer: int) -> dict[str, Param]:
    return {**attention_params(arch), **moe_params(arch)}


FAMILY = Family(
    name="qwen3_moe", hf_class="Qwen3Moe", read=read, layer_tensors=layer_tensors, layer_params=layer_params,
    config_overrides=moe_config, mbridge=True,
    fields=ROUTED | {"attention_bias", "use_sliding_window", "sliding_window", "norm_topk_prob", "mlp_only_layers",
                     "decoder_sparse_step", "num_local_experts"},
    synonyms=(("num_experts", "num_local_experts"),),
    tiny_fields={"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True},
)
