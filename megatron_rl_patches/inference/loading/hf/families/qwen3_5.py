"""Qwen3.5 (`qwen3_5`: the vision-language wrapper, weights under `model.language_model.*`, the
vision tower `model.visual.*` and the MTP block `mtp.*` skipped for scoring; `qwen3_5_text`: the
text model, `model.layers.*`) and its MoE (`qwen3_5_moe` / `qwen3_5_moe_text`). `layer_types` mixes
gated-delta-net linear-attention layers (inference/gated_delta_net.py) with gated full attention
(`q_proj` holds per head the query and a sigmoid output gate: reordered into megatron-core's
`attention_output_gate` layout), per-head q/k norms and partial RoPE (0.25). Every RMSNorm but the
linear-attention layer's gated one is zero-centred ((1 + w) x^): 1 is added at load (exact)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import (
    HFArchitecture,
    decoder_architecture,
    read_count,
    read_natural,
)
from megatron_rl_patches.inference.loading.hf.checkpoint_config import text_config
from megatron_rl_patches.inference.loading.hf.families.common import (
    moe_config,
    moe_params,
    moe_tensors,
    needs_config_field,
    stage_args,
    swiglu_params,
    swiglu_tensors,
)
from megatron_rl_patches.inference.loading.hf.families.common_kinds import CENTRED, COLUMN, REPLICATE, ROW, VOCAB
from megatron_rl_patches.inference.loading.hf.families.family import Family, Param, Shape, parallel_problems
from megatron_rl_patches.inference.loading.hf.families.hybrid_kinds import GATED_QKV, GDN_CONV, GDN_IN
from megatron_rl_patches.inference.loading.hf.families.qwen3_moe import sparse_step_problems

LINEAR, FULL = "linear_attention", "full_attention"
WRAPPED = "model.language_model."  # the wrapper's text model
SKIPPED = ("model.visual.", "mtp.")  # the vision tower and the MTP block: not scored
SHARED = "mlp.shared_expert."


@dataclass(frozen=True)
class LinearShape:
    """The gated delta net's widths (config.json's linear_* fields)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_width(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_width(self) -> int:
        return self.value_heads * self.value_head_dim


def vision_tower_params(config: dict[str, Any], source: str) -> int:
    """The parameters of the wrapper's vision tower (`vision_config`; 0 without one): a patch embedding
    and learned positions, `depth` pre-norm blocks (LayerNorms, fused qkv, GELU MLP, all with biases)
    and the merger of spatial_merge_size^2 patches into the text width. Not built; counted apart."""
    vision = config.get("vision_config")
    if not vision:
        return 0
    if not isinstance(vision, dict):
        raise ValueError(f"{source}: config.json's vision_config must be an object, got {type(vision).__name__}")
    h, inner = read_count(vision, source, "hidden_size"), read_count(vision, source, "intermediate_size")
    patch = (read_count(vision, source, "in_channels", default=3) * read_count(vision, source, "temporal_patch_size")
             * read_count(vision, source, "patch_size") ** 2)
    merged = h * read_count(vision, source, "spatial_merge_size") ** 2
    out = read_count(vision, source, "out_hidden_size")
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (inner * h + inner) + (h * inner + h)
    merger = 2 * h + (merged * merged + merged) + (out * merged + out)
    embed = h * patch + h + read_count(vision, source, "num_position_embeddings") * h
    return embed + read_count(vision, source, "depth") * block + merger


def read_layer_types(config: dict[str, Any], source: str, layers: int) -> tuple[str, ...]:
    """`layer_types` (or every `full_attention_interval`-th layer full attention, as transformers fills it)."""
    types = config.get("layer_types")
    if types is None:
        interval = read_count(config, source, "full_attention_interval", default=4)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in (LINEAR, FULL) for t in types):
        raise ValueError(f"{source}: config.json's layer_types must list {LINEAR!r} or {FULL!r} for each of the "
                         f"{layers} layers, got {types!r}")
    return tuple(types)


def read_linear(config: dict[str, Any], source: str) -> LinearShape:
    shape = LinearShape(*(read_count(config, source, name) for name in (
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim")))
    if shape.value_heads % shape.key_heads:
        raise ValueError(f"{source}: linear_num_value_heads={shape.value_heads} is not a multiple of "
                         f"linear_num_key_heads={shape.key_heads}")
    return shape


def read_hybrid(config: dict[str, Any], source: str, moe: bool) -> HFArchitecture:
    """The architecture of a Qwen3.5 / Qwen3-Next text config (the wrapper's `text_config`)."""
    text = text_config(config, source)
    if moe and text.get("intermediate_size") is None:  # every layer MoE: Qwen3.5-MoE writes no dense width
        text = {**text, "intermediate_size": text.get("moe_intermediate_size")}
    refused = []
    if text.get("attention_bias"):
        refused.append("attention_bias=true")
    if moe:
        refused += sparse_step_problems(text)
    arch = decoder_architecture(text, source, qkv_bias=False, qk_norm=True, moe=moe, refused=refused,
                                partial_rotary=0.25)
    shared = read_natural(text, source, "shared_expert_intermediate_size") if moe else 0
    # Qwen3.5-MoE always renormalizes its top-k weights; Qwen3-Next where norm_topk_prob (default true)
    normalized = moe and bool(text.get("norm_topk_prob", True))
    return replace(arch, model_type=str(config.get("model_type")), norm_topk_prob=normalized,
                   layer_types=read_layer_types(text, source, arch.num_layers), linear=read_linear(text, source),
                   vision_params=vision_tower_params(config, source),
                   shared_expert_ffn=shared, shared_expert_gate=shared > 0)


def read_dense(config: dict[str, Any], source: str) -> HFArchitecture:
    return read_hybrid(config, source, moe=False)


def read_moe(config: dict[str, Any], source: str) -> HFArchitecture:
    return read_hybrid(config, source, moe=True)


def gated_attention_tensors(arch: HFArchitecture) -> dict[str, Shape]:
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    return {"self_attn.q_proj.weight": (2 * q, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
            "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}


def gated_attention_params() -> dict[str, Param]:
    a = "self_attention."
    return {a + "linear_qkv.weight": Param(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                            "self_attn.v_proj.weight"), GATED_QKV),
            a + "linear_proj.weight": Param(("self_attn.o_proj.weight",), ROW),
            a + "q_layernorm.weight": Param(("self_attn.q_norm.weight",), CENTRED),
            a + "k_layernorm.weight": Param(("self_attn.k_norm.weight",), CENTRED)}


def linear_attention_tensors(arch: HFArchitecture) -> dict[str, Shape]:
    """Qwen3.5's gated delta net: q/k/v, z, b and a projected apart."""
    m, h = arch.linear, arch.hidden_size
    conv = 2 * m.key_width + m.value_width
    return {"linear_attn.in_proj_qkv.weight": (conv, h), "linear_attn.in_proj_z.weight": (m.value_width, h),
            "linear_attn.in_proj_b.weight": (m.value_heads, h), "linear_attn.in_proj_a.weight": (m.value_heads, h),
            **linear_attention_common_tensors(arch)}


def linear_attention_common_tensors(arch: HFArchitecture) -> dict[str, Shape]:
    m, h = arch.linear, arch.hidden_size
    return {"linear_attn.conv1d.weight": (2 * m.key_width + m.value_width, 1, m.conv_kernel),
            "linear_attn.A_log": (m.value_heads,), "linear_attn.dt_bias": (m.value_heads,),
            "linear_attn.norm.weight": (m.value_head_dim,), "linear_attn.out_proj.weight": (h, m.value_width)}


def linear_attention_common_params() -> dict[str, Param]:
    a = "self_attention."
    return {a + "conv1d.weight": Param(("linear_attn.conv1d.weight",), GDN_CONV),
            a + "A_log": Param(("linear_attn.A_log",), COLUMN),
            a + "dt_bias": Param(("linear_attn.dt_bias",), COLUMN),
            a + "out_norm.weight": Param(("linear_attn.norm.weight",), REPLICATE),
            a + "out_proj.weight": Param(("linear_attn.out_proj.weight",), ROW)}


def linear_attention_params() -> dict[str, Param]:
    names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    return {"self_attention.in_proj.weight": Param(tuple(f"linear_attn.{n}.weight" for n in names), GDN_IN),
            **linear_attention_common_params()}


def mlp_tensors(arch: HFArchitecture) -> dict[str, Shape]:
    if not arch.is_moe:
        return swiglu_tensors(arch)
    return moe_tensors(arch, SHARED)


def mlp_params(arch: HFArchitecture) -> dict[str, Param]:
    if not arch.is_moe:
        return swiglu_params()
    return moe_params(arch, SHARED)


NORMS = {"input_layernorm.weight": Param(("input_layernorm.weight",), CENTRED),
         "pre_mlp_layernorm.weight": Param(("post_attention_layernorm.weight",), CENTRED)}


def layer_tensors(arch: HFArchitecture, layer: int) -> dict[str, Shape]:
    h = arch.hidden_size
    mixer = linear_attention_tensors(arch) if arch.layer_types[layer] == LINEAR else gated_attention_tensors(arch)
    return {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,), **mixer, **mlp_tensors(arch)}


def layer_params(arch: HFArchitecture, layer: int) -> dict[str, Param]:
    mixer = linear_attention_params() if arch.layer_types[layer] == LINEAR else gated_attention_params()
    return {**NORMS, **mixer, **mlp_params(arch)}


def text_outer_params(arch: HFArchitecture, prefix: str = "model.") -> dict[str, Param]:
    embed = prefix + "embed_tokens.weight"
    return {"embedding.word_embeddings.weight": Param((embed,), VOCAB),
            "decoder.final_layernorm.weight": Param((prefix + "norm.weight",), CENTRED),
            "output_layer.weight": Param((embed if arch.tied else "lm_head.weight",), VOCAB)}


def wrapped_outer_params(arch: HFArchitecture) -> dict[str, Param]:
    return text_outer_params(arch, WRAPPED)


def wrapped_outer_tensors(arch: HFArchitecture) -> tuple[dict[str, Shape], dict[str, Shape]]:
    after: dict[str, Shape] = {WRAPPED + "norm.weight": (arch.hidden_size,)}
    if not arch.tied:
        after["lm_head.weight"] = (arch.vocab_size, arch.hidden_size)
    return {WRAPPED + "embed_tokens.weight": (arch.vocab_size, arch.hidden_size)}, after


def skipped(arch: HFArchitecture) -> tuple[str, ...]:
    return SKIPPED


def config_overrides(arch: HFArchitecture) -> dict[str, Any]:
    """The gated full attention (megatron-core >= 0.16) and the routed / shared experts."""
    needs_config_field(arch, "attention_output_gate", "gated attention with gated-delta-net linear attention")
    return {"attention_output_gate": True, **(moe_config(arch) if arch.is_moe else {})}


def stage_spec(arch: HFArchitecture, config: Any, vp_stage: int | None, pp_rank: int | None = None) -> Any:
    """This pipeline stage's layers on megatron-core's local spec, the linear-attention ones with the
    package's gated delta net as their self-attention; `pp_rank`: the stage (default parallel_state's)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    # lazy: import cost: memory --hf plans without torch (gated_delta_net imports it)
    from megatron_rl_patches.inference.gated_delta_net import GatedDeltaNetLayer

    stage = stage_args(vp_stage, pp_rank)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", **stage)
    offset = get_transformer_layer_offset(config, **stage)
    m = arch.linear
    mixer = ModuleSpec(module=GatedDeltaNetLayer, params=dict(
        key_heads=m.key_heads, value_heads=m.value_heads, key_head_dim=m.key_head_dim,
        value_head_dim=m.value_head_dim, conv_kernel=m.conv_kernel))
    layers = []
    for index, spec in enumerate(block.layer_specs):
        if arch.layer_types[offset + index] == LINEAR:
            spec = copy.deepcopy(spec)
            spec.submodules.self_attention = mixer
        layers.append(spec)
    block.layer_specs = layers
    return block


def hybrid_parallel_problems(arch: HFArchitecture, tp: int, ep: int) -> list[str]:
    """The attention heads as usual, and the linear attention's key and value heads split over TP."""
    m = arch.linear
    return parallel_problems(arch, tp, ep) + [
        f"{name}={value} is not a multiple of the tensor-parallel size {tp}"
        for name, value in (("linear_num_key_heads", m.key_heads), ("linear_num_value_heads", m.value_heads))
        if value % tp]


TINY = {"head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4, "num_hidden_layers": 4,
        "layer_types": [LINEAR, LINEAR, LINEAR, FULL],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}
TINY_MOE = {**TINY, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 24}
HYBRID = frozenset({"text_config", "vision_config", "layer_types", "full_attention_interval", "linear_num_key_heads",
                    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                    "attention_bias"})
# transformers' Qwen3.5-MoE reads no norm_topk_prob, mlp_only_layers nor decoder_sparse_step (Qwen3-Next does)
HYBRID_MOE = HYBRID | {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"}
TEXT_FAMILY = Family(
    name="qwen3_5_text", hf_class="Qwen3_5Text", read=read_dense, layer_tensors=layer_tensors,
    layer_params=layer_params, outer_params=text_outer_params, config_overrides=config_overrides, stage_spec=stage_spec,
    parallel_problems=hybrid_parallel_problems, skipped=skipped, tiny_fields=TINY, fields=HYBRID,
)
FAMILY = replace(TEXT_FAMILY, name="qwen3_5", hf_class="Qwen3_5", outer_params=wrapped_outer_params,
                 outer_tensors=wrapped_outer_tensors, layer_prefix=WRAPPED + "layers.{layer}.")
# the published Qwen3.5-MoE checkpoints stack their experts (mlp.experts.gate_up_proj / down_proj)
MOE_TEXT_FAMILY = replace(TEXT_FAMILY, name="qwen3_5_moe_text", hf_class="Qwen3_5MoeText", read=read_moe,
                          tiny_fields=TINY_MOE, stacked_experts=True, fields=HYBRID_MOE)
MOE_FAMILY = replace(FAMILY, name="qwen3_5_moe", hf_class="Qwen3_5Moe", read=read_moe, tiny_fields=TINY_MOE,
                     fields=HYBRID_MOE,
                     stacked_experts=True)
