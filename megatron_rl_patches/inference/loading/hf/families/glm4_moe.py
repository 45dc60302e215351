"""GLM-4.5 / 4.6 / 4.7 (`model_type` glm4_moe): attention with q/k/v biases (`attention_bias`),
optional per-head q/k norm (`use_qk_norm`) and RoPE on half of each head (`partial_rotary_factor`
0.5, rotate-half layout: megatron-core's rotary_percent); dense first layers
(`first_k_dense_replace`), then a sigmoid router with a per-expert score correction
(`e_score_correction_bias`: megatron-core's expert_bias), group-limited choice (`n_group` /
`topk_group`), weights renormalized and scaled (`routed_scaling_factor`), and shared experts
(`n_shared_experts`). The MTP layer real checkpoints store (`num_nextn_predict_layers`) is skipped."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import (
    HFArchitecture,
    decoder_architecture,
    read_count,
    read_field,
    read_natural,
    read_number,
)
from megatron_rl_patches.inference.loading.hf.families.common import (
    attention_params,
    attention_tensors,
    moe_config,
    moe_params,
    moe_tensors,
    shared_expert_params,
    shared_expert_tensors,
    swiglu_params,
    swiglu_tensors,
)
from megatron_rl_patches.inference.loading.hf.families.common_kinds import REPLICATE
from megatron_rl_patches.inference.loading.hf.families.family import Family, Param, Shape
from megatron_rl_patches.inference.loading.hf.families.fields import GROUPED

SHARED = "mlp.shared_experts."
# names transformers' Glm4MoeConfig / DeepseekV3Config map onto one attribute
SYNONYMS = (("n_routed_experts", "num_local_experts"), ("num_nextn_predict_layers", "num_mtp_layers"))


def read_groups(config: dict[str, Any], source: str) -> tuple[int, int]:
    """(n_group, topk_group): the routed experts in n_group equal groups, a token's experts taken from
    its best topk_group groups; a ValueError naming the field where transformers or megatron-core
    cannot route so (an assertion, a division by zero, or a build transformers refuses)."""
    groups = read_count(config, source, "n_group", default=1)
    group_topk = read_count(config, source, "topk_group", default=1)
    experts = read_count(config, source, "n_routed_experts")
    if experts % groups:
        raise ValueError(f"{source}: config.json's n_group={groups} does not divide n_routed_experts={experts}; "
                         "the experts are routed in n_group equal groups: n_group must be a divisor of it")
    if group_topk > groups:
        raise ValueError(f"{source}: config.json's topk_group={group_topk} exceeds n_group={groups}; a token's "
                         f"experts come from its best topk_group of the n_group groups: set topk_group in 1..{groups}")
    return groups, group_topk


def read_routed_scaling(config: dict[str, Any], source: str) -> float:
    """routed_scaling_factor (1.0 where config.json writes none): a positive number."""
    return read_number(config, source, "routed_scaling_factor",
                       read_field(config, source, "routed_scaling_factor", default=1.0))


def group_problems(config: dict[str, Any], groups: int, group_topk: int) -> list[str]:
    """Group-limited routing megatron-core does not compute as transformers does: it scores a group
    by its top num_experts_per_tok // topk_group experts, transformers by its top 2."""
    topk = config.get("num_experts_per_tok")
    if group_topk < groups and isinstance(topk, int) and topk // group_topk != 2:
        return [f"n_group={groups} with topk_group={group_topk} and num_experts_per_tok={topk} (megatron-core "
                "scores a group by its top num_experts_per_tok // topk_group experts, transformers by its top 2)"]
    return []


def read(config: dict[str, Any], source: str) -> HFArchitecture:
    groups, group_topk = read_groups(config, source)
    refused = group_problems(config, groups, group_topk)
    if config.get("norm_topk_prob") is False:
        refused.append("norm_topk_prob=false (megatron-core's sigmoid router always renormalizes)")
    arch = decoder_architecture(config, source, qkv_bias=False, qk_norm=bool(config.get("use_qk_norm", False)),
                                moe=True, refused=refused, partial_rotary=0.5)
    shared = read_natural(config, source, "n_shared_experts")
    first = config.get("first_k_dense_replace")
    dense = 1 if first is None else read_natural(config, source, "first_k_dense_replace")
    return replace(
        arch, norm_topk_prob=True, router="sigmoid", expert_bias=True, router_groups=groups,
        router_group_topk=group_topk, routed_scaling=read_routed_scaling(config, source),
        shared_expert_ffn=shared * arch.expert_ffn_hidden_size,
        dense_layers=min(dense, arch.num_layers),
        mtp_layers=read_natural(config, source, "num_nextn_predict_layers"),
    )


def layer_tensors(arch: HFArchitecture, layer: int) -> dict[str, Shape]:
    if layer < arch.dense_layers:
        return {**attention_tensors(arch), **swiglu_tensors(arch)}
    shared = shared_expert_tensors(arch, SHARED) if arch.shared_expert_ffn else {}
    return {**attention_tensors(arch), **moe_tensors(arch), "mlp.gate.e_score_correction_bias": (arch.num_experts,),
            **shared}


def layer_params(arch: HFArchitecture, layer: int) -> dict[str, Param]:
    if layer < arch.dense_layers:
        return {**attention_params(arch), **swiglu_params()}
    shared = shared_expert_params(arch, SHARED) if arch.shared_expert_ffn else {}
    return {**attention_params(arch), **moe_params(),
            "mlp.router.expert_bias": Param(("mlp.gate.e_score_correction_bias",), REPLICATE), **shared}


FAMILY = Family(
    name="glm4_moe", hf_class="Glm4Moe", read=read, layer_tensors=layer_tensors, layer_params=layer_params,
    config_overrides=moe_config, fields=GROUPED | {"attention_bias", "use_qk_norm"}, synonyms=SYNONYMS,
    tiny_fields={"moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4,
                 "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
                 "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True},
)
