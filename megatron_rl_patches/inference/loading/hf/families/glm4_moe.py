"""GLM-4.5 / 4.6 / 4.7 (`model_type` glm4_moe): attention with q/k/v biases (`attention_bias`),
optional per-head q/k norm (`use_qk_norm`) and RoPE on half of each head (`partial_rotary_factor`
0.5, rotate-half layout: megatron-core's rotary_percent); dense first layers
(`first_k_dense_replace`), then a sigmoid router with a per-expert score correction
(`e_score_correction_bias`), group-limited choice and scaled weights (sigmoid_router.py), and shared experts
(`n_shared_experts`). The MTP layer real checkpoints store (`num_nextn_predict_layers`) is skipped."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import (
    HFArchitecture,
    decoder_architecture,
    read_natural,
)
from megatron_rl_patches.inference.loading.hf.families.common import (
    attention_params,
    attention_tensors,
    moe_config,
    moe_params,
    moe_tensors,
    swiglu_params,
    swiglu_tensors,
)
from megatron_rl_patches.inference.loading.hf.families.common_kinds import REPLICATE
from megatron_rl_patches.inference.loading.hf.families.family import Family, Param, Shape
from megatron_rl_patches.inference.loading.hf.families.fields import GROUPED
from megatron_rl_patches.inference.loading.hf.families.sigmoid_router import (
    SigmoidRouter,
    read_groups,
    read_routed_scaling,
    router_problems,
)

SHARED = "mlp.shared_experts."
# names transformers' Glm4MoeConfig / DeepseekV3Config map onto one attribute
SYNONYMS = (("n_routed_experts", "num_local_experts"), ("num_nextn_predict_layers", "num_mtp_layers"))


def read(config: dict[str, Any], source: str) -> HFArchitecture:
    groups, group_topk = read_groups(config, source)
    arch = decoder_architecture(config, source, qkv_bias=False, qk_norm=bool(config.get("use_qk_norm", False)),
                                moe=True, refused=router_problems(config, groups, group_topk), partial_rotary=0.5)
    shared = read_natural(config, source, "n_shared_experts")
    first = config.get("first_k_dense_replace")
    dense = 1 if first is None else read_natural(config, source, "first_k_dense_replace")
    return replace(
        arch, norm_topk_prob=True,
        sigmoid_router=SigmoidRouter(groups, group_topk, read_routed_scaling(config, source)),
        shared_expert_ffn=shared * arch.expert_ffn_hidden_size,
        dense_layers=min(dense, arch.num_layers),
        mtp_layers=read_natural(config, source, "num_nextn_predict_layers"),
    )


def layer_tensors(arch: HFArchitecture, layer: int) -> dict[str, Shape]:
    if layer < arch.dense_layers:
        return {**attention_tensors(arch), **swiglu_tensors(arch)}
    return {**attention_tensors(arch), **moe_tensors(arch, SHARED),
            "mlp.gate.e_score_correction_bias": (arch.num_experts,)}


def layer_params(arch: HFArchitecture, layer: int) -> dict[str, Param]:
    if layer < arch.dense_layers:
        return {**attention_params(arch), **swiglu_params()}
    return {**attention_params(arch), **moe_params(arch, SHARED),
            "mlp.router.expert_bias": Param(("mlp.gate.e_score_correction_bias",), REPLICATE)}


FAMILY = Family(
    name="glm4_moe", hf_class="Glm4Moe", read=read, layer_tensors=layer_tensors, layer_params=layer_params,
    config_overrides=moe_config, fields=GROUPED | {"attention_bias", "use_qk_norm"}, synonyms=SYNONYMS,
    tiny_fields={"moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4,
                 "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
                 "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True},
)
