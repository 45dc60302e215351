"""Qwen1.5-MoE / Qwen2-MoE (`model_type` qwen2_moe): Qwen2's attention (q/k/v biases: `qkv_bias`,
on by default), a top-k softmax router over SwiGLU experts (renormalized when `norm_topk_prob`)
and a shared expert whose output is scaled by sigmoid(`shared_expert_gate` . x) (megatron-core's
gated shared expert); dense layers among the MoE ones (`mlp_only_layers`, `decoder_sparse_step`)
are refused."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture, decoder_architecture, read_natural
from megatron_rl_patches.inference.loading.hf.families.common import (
    attention_params,
    attention_tensors,
    moe_config,
    moe_params,
    moe_tensors,
)
from megatron_rl_patches.inference.loading.hf.families.family import Family, Param, Shape
from megatron_rl_patches.inference.loading.hf.families.fields import ROUTED, SLIDING
from megatron_rl_patches.inference.loading.hf.families.qwen3_moe import sparse_step_problems

SHARED = "mlp.shared_expert."


def read(config: dict[str, Any], source: str) -> HFArchitecture:
    arch = decoder_architecture(config, source, qkv_bias=bool(config.get("qkv_bias", True)), qk_norm=False, moe=True,
                                refused=sparse_step_problems(config))
    shared = read_natural(config, source, "shared_expert_intermediate_size")
    return replace(arch, shared_expert_ffn=shared, shared_expert_gate=shared > 0)


def layer_tensors(arch: HFArchitecture, layer: int) -> dict[str, Shape]:
    return {**attention_tensors(arch), **moe_tensors(arch, SHARED)}


def layer_params(arch: HFArchitecture, layer: int) -> dict[str, Param]:
    return {**attention_params(arch), **moe_params(arch, SHARED)}


FAMILY = Family(
    name="qwen2_moe", hf_class="Qwen2Moe", read=read, layer_tensors=layer_tensors, layer_params=layer_params,
    config_overrides=moe_config,
    fields=SLIDING | ROUTED | {"qkv_bias", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step",
                              "shared_expert_intermediate_size"},
    tiny_fields={"head_dim": None, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
                 "shared_expert_intermediate_size": 24, "norm_topk_prob": False},
)
