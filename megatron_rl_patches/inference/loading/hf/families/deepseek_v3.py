"""DeepSeek-V3 (`model_type` deepseek_v3; Moonlight with `q_lora_rank: null`; Kimi-K2, whose
config.json says `kimi_k2` with deepseek_v3's fields): multi-latent attention (families/mla.py) with
plain RoPE or YaRN, SwiGLU MLPs; the multi-token prediction layers stored after the last layer
(`num_nextn_predict_layers`) are left out. Layers past `first_k_dense_replace` are MoE layers, which
this family does not build yet: only configs whose every layer is dense are served."""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import (
    HFArchitecture,
    decoder_architecture,
    read_count,
    refuse_unmapped,
)
from megatron_rl_patches.inference.loading.hf.families import mla
from megatron_rl_patches.inference.loading.hf.families.common import swiglu_params, swiglu_tensors
from megatron_rl_patches.inference.loading.hf.families.family import Family, Param, Shape, parallel_problems


def read(config: dict[str, Any], source: str) -> HFArchitecture:
    layers = read_count(config, source, "num_hidden_layers")
    dense = config.get("first_k_dense_replace", 0)
    if config.get("n_routed_experts") and (not isinstance(dense, int) or dense < layers):
        refuse_unmapped(source, [f"MoE layers (first_k_dense_replace={dense!r} < num_hidden_layers={layers}, "
                                 f"{config['n_routed_experts']} routed experts)"])
    shape = mla.read_mla(config, source)
    # the RoPE is MLA's own (MLATransformerConfig), read above: the common reader sees plain RoPE
    plain = {**config, "rope_parameters": None, "rope_scaling": None, "rope_theta": shape.rope.theta}
    arch = decoder_architecture(plain, source, qkv_bias=False, qk_norm=False, moe=False)
    extra = config.get("num_nextn_predict_layers") or 0
    return dataclasses.replace(arch, mla=shape, extra_layers=int(extra))


def layer_tensors(arch: HFArchitecture, layer: int) -> dict[str, Shape]:
    return {**mla.mla_tensors(arch), **swiglu_tensors(arch)}


def layer_params(arch: HFArchitecture, layer: int) -> dict[str, Param]:
    return {**mla.mla_params(arch), **swiglu_params()}


def mla_parallel_problems(arch: HFArchitecture, tp: int, ep: int) -> list[str]:
    """The heads and the latent widths split over the tensor-parallel ranks."""
    m = arch.mla
    widths = {"num_attention_heads": arch.num_heads, "kv_lora_rank + qk_rope_head_dim": m.kv_lora_rank
              + m.qk_rope_head_dim, "q_lora_rank": m.q_lora_rank or tp}
    return parallel_problems(arch, tp, ep) + [f"{name}={value} is not a multiple of the tensor-parallel size {tp}"
                                              for name, value in widths.items() if value % tp]


def no_model_rope(arch: HFArchitecture) -> dict[str, Any]:
    """GPTModel's own RoPE is off: MLA makes its rotary embedding from MLATransformerConfig."""
    return {"position_embedding_type": "none", "max_sequence_length": arch.max_positions}


FAMILY = Family(
    name="deepseek_v3", hf_class="DeepseekV3", read=read, layer_tensors=layer_tensors, layer_params=layer_params,
    config_overrides=mla.mla_config, config_class=mla.mla_config_class, layer_spec=mla.mla_spec,
    model_args=no_model_rope, parallel_problems=mla_parallel_problems, aliases=("kimi_k2",),
    tiny_fields={"num_key_value_heads": 4, "head_dim": None, "q_lora_rank": 24, "kv_lora_rank": 16,
                 "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12, "first_k_dense_replace": 2,
                 "rope_interleave": True},
)
