"""DeepSeek-V3 (`model_type` deepseek_v3; Moonlight with `q_lora_rank: null`; Kimi-K2, whose
config.json says `kimi_k2` with deepseek_v3's fields): multi-latent attention (families/mla.py) with
plain RoPE or YaRN, dense first layers (`first_k_dense_replace`) then glm4_moe's mixture of experts
(sigmoid router with `e_score_correction_bias`, group-limited choice, routed scaling, shared
experts); the multi-token prediction layers stored after the last layer are skipped."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import (
    HFArchitecture,
    decoder_architecture,
    read_count,
    read_natural,
)
from megatron_rl_patches.inference.loading.hf.families import glm4_moe, mla
from megatron_rl_patches.inference.loading.hf.families.common import moe_config, swiglu_params, swiglu_tensors
from megatron_rl_patches.inference.loading.hf.families.family import Family, Param, Shape, parallel_problems
from megatron_rl_patches.inference.loading.hf.families.fields import GROUPED
from megatron_rl_patches.inference.loading.hf.families.sigmoid_router import (
    SigmoidRouter,
    read_groups,
    read_routed_scaling,
    router_problems,
)


def _moe_refused(config: dict[str, Any], groups: int, group_topk: int) -> list[str]:
    refused = router_problems(config, groups, group_topk)
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        refused.append(f"scoring_func={config['scoring_func']!r} (transformers' DeepSeek-V3 scores by sigmoid)")
    return refused


def read(config: dict[str, Any], source: str, partial_rotary: float | None = None) -> HFArchitecture:
    """`partial_rotary`: None as transformers' DeepSeek-V3 (its default RoPE ignores partial_rotary_factor),
    GLM-4.7-Flash's 1.0 (read, then refused by MLA unless 1)."""
    layers = read_count(config, source, "num_hidden_layers")
    dense = min(read_natural(config, source, "first_k_dense_replace"), layers)
    moe = bool(config.get("n_routed_experts")) and dense < layers
    groups, group_topk = read_groups(config, source) if moe else (1, 1)
    shape = mla.read_mla(config, source)
    arch = decoder_architecture(config, source, qkv_bias=False, qk_norm=False, moe=moe,
                                refused=_moe_refused(config, groups, group_topk) if moe else [],
                                partial_rotary=partial_rotary)
    arch = replace(arch, mla=shape, mtp_layers=read_natural(config, source, "num_nextn_predict_layers"))
    mla.refuse_rope(arch)
    if not moe:
        return arch
    return replace(
        arch, norm_topk_prob=True,
        sigmoid_router=SigmoidRouter(groups, group_topk, read_routed_scaling(config, source)),
        shared_expert_ffn=read_natural(config, source, "n_shared_experts") * arch.expert_ffn_hidden_size,
        dense_layers=dense,
    )


def _mlp(named: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in named.items() if name.startswith("mlp.")}


def layer_tensors(arch: HFArchitecture, layer: int) -> dict[str, Shape]:
    """MLA's tensors and glm4_moe's MLP of the layer (dense or experts), or a SwiGLU MLP."""
    mlp = _mlp(glm4_moe.layer_tensors(arch, layer)) if arch.is_moe else swiglu_tensors(arch)
    return {**mla.mla_tensors(arch), **mlp}


def layer_params(arch: HFArchitecture, layer: int) -> dict[str, Param]:
    mlp = _mlp(glm4_moe.layer_params(arch, layer)) if arch.is_moe else swiglu_params()
    return {**mla.mla_params(arch), **mlp}


def mla_parallel_problems(arch: HFArchitecture, tp: int, ep: int) -> list[str]:
    """The heads and the latent widths split over the tensor-parallel ranks."""
    m = arch.mla
    widths = {"num_attention_heads": arch.num_heads, "kv_lora_rank + qk_rope_head_dim": m.kv_lora_rank
              + m.qk_rope_head_dim, "q_lora_rank": m.q_lora_rank or tp}
    return parallel_problems(arch, tp, ep) + [f"{name}={value} is not a multiple of the tensor-parallel size {tp}"
                                              for name, value in widths.items() if value % tp]


def config_overrides(arch: HFArchitecture) -> dict[str, Any]:
    return {**mla.mla_config(arch), **(moe_config(arch) if arch.is_moe else {})}


def no_model_rope(arch: HFArchitecture) -> dict[str, Any]:
    """GPTModel's own RoPE is off: MLA makes its rotary embedding from MLATransformerConfig."""
    return {"position_embedding_type": "none", "max_sequence_length": arch.max_positions}


FAMILY = Family(
    name="deepseek_v3", hf_class="DeepseekV3", read=read, layer_tensors=layer_tensors, layer_params=layer_params,
    config_overrides=config_overrides, config_class=mla.mla_config_class, layer_spec=mla.mla_spec,
    core_attention=mla.sdpa_core_attention, model_args=no_model_rope, parallel_problems=mla_parallel_problems,
    aliases=("kimi_k2",), synonyms=glm4_moe.SYNONYMS,
    # scoring_func: DeepSeek's and Kimi-K2's remote code read it (transformers' class does not): refused unless sigmoid
    fields=GROUPED | {"attention_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "rope_interleave", "scoring_func"},
    tiny_fields={"num_key_value_heads": 4, "head_dim": None, "q_lora_rank": 24, "kv_lora_rank": 16,
                 "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12, "rope_interleave": True,
                 "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4,
                 "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
                 "norm_topk_prob": True},
)
