"""Multi-latent attention (DeepSeek-V3's, Kimi-K2's, Moonlight's): its config.json fields, its
Hugging Face tensors and the Megatron MLASelfAttention parameters made from them (its own fuse
kinds, the rotary rows reordered for megatron-core, are in mla_kinds.py), its MLATransformerConfig
fields and a local layer spec that runs on CPU (the SDPA core attention by default; megatron-core
0.16's isinstance against a mocked TELinear disarmed)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import (
    HFArchitecture,
    UnsupportedCheckpointError,
    read_count,
)
from megatron_rl_patches.inference.loading.hf.families.common_kinds import COLUMN, REPLICATE, ROW
from megatron_rl_patches.inference.loading.hf.families.family import Param, Shape
from megatron_rl_patches.inference.loading.hf.families.mla_kinds import MLA_KV_DOWN, MLA_Q
from megatron_rl_patches.settings import ascii_int


@dataclass(frozen=True)
class MLAShape:
    """The widths of multi-latent attention (q_lora_rank None: queries projected in one step)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def read_mla(config: dict[str, Any], source: str) -> MLAShape:
    """The MLA fields of config.json (UnsupportedCheckpointError naming what megatron-core cannot build)."""
    if config.get("attention_bias"):
        raise UnsupportedCheckpointError(f"{source}: the converter does not map attention_bias=true with "
                                         "multi-latent attention (megatron-core's MLA has no q/kv/o biases)")
    interleave = config.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise ValueError(f"{source}: rope_interleave must be true or false, got {interleave!r}")
    q_lora = config.get("q_lora_rank")
    return MLAShape(
        q_lora_rank=None if q_lora is None else read_count(config, source, "q_lora_rank"),
        kv_lora_rank=read_count(config, source, "kv_lora_rank"),
        qk_nope_head_dim=read_count(config, source, "qk_nope_head_dim"),
        qk_rope_head_dim=read_count(config, source, "qk_rope_head_dim"),
        v_head_dim=read_count(config, source, "v_head_dim"),
        rope_interleave=interleave,
    )


def refuse_rope(arch: HFArchitecture) -> None:
    """megatron-core's MLA makes its own rotary embedding: plain RoPE or YaRN over whole rotary dims."""
    if arch.rope.kind not in ("default", "yarn") or arch.rope.partial != 1.0:
        raise UnsupportedCheckpointError(
            f"{arch.source}: RoPE scaling {arch.rope.kind!r} (partial_rotary_factor {arch.rope.partial}) with "
            "multi-latent attention (megatron-core's MLA builds plain RoPE or YaRN on its rotary dims only)")


def mla_tensors(arch: HFArchitecture) -> dict[str, Shape]:
    """The two layer norms and the attention's Hugging Face tensors."""
    m, h, n = arch.mla, arch.hidden_size, arch.num_heads
    out: dict[str, Shape] = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    if m.q_lora_rank is None:
        out["self_attn.q_proj.weight"] = (n * m.q_head_dim, h)
    else:
        out.update({"self_attn.q_a_proj.weight": (m.q_lora_rank, h), "self_attn.q_a_layernorm.weight": (m.q_lora_rank,),
                    "self_attn.q_b_proj.weight": (n * m.q_head_dim, m.q_lora_rank)})
    out.update({
        "self_attn.kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
        "self_attn.kv_a_layernorm.weight": (m.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        "self_attn.o_proj.weight": (h, n * m.v_head_dim),
    })
    return out


def mla_params(arch: HFArchitecture) -> dict[str, Param]:
    """MLASelfAttention's parameters: the projections split over the ranks by their output rows
    (megatron-core gathers the down projections' again), the latent norms whole."""
    a = "self_attention."
    out = {
        "input_layernorm.weight": Param(("input_layernorm.weight",), REPLICATE),
        "pre_mlp_layernorm.weight": Param(("post_attention_layernorm.weight",), REPLICATE),
        a + "linear_kv_down_proj.weight": Param(("self_attn.kv_a_proj_with_mqa.weight",), MLA_KV_DOWN),
        a + "kv_layernorm.weight": Param(("self_attn.kv_a_layernorm.weight",), REPLICATE),
        a + "linear_kv_up_proj.weight": Param(("self_attn.kv_b_proj.weight",), COLUMN),
        a + "linear_proj.weight": Param(("self_attn.o_proj.weight",), ROW),
    }
    if arch.mla.q_lora_rank is None:
        out[a + "linear_q_proj.weight"] = Param(("self_attn.q_proj.weight",), MLA_Q)
    else:
        out.update({a + "linear_q_down_proj.weight": Param(("self_attn.q_a_proj.weight",), COLUMN),
                    a + "q_layernorm.weight": Param(("self_attn.q_a_layernorm.weight",), REPLICATE),
                    a + "linear_q_up_proj.weight": Param(("self_attn.q_b_proj.weight",), MLA_Q)})
    return out


def mla_config(arch: HFArchitecture) -> dict[str, Any]:
    """MLATransformerConfig fields: the widths, the latent norms on, RoPE or YaRN of config.json."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    m, rope = arch.mla, arch.rope
    refuse_unbuildable(arch)
    disarm_mocked_te_in_mla()
    values: dict[str, Any] = dict(
        multi_latent_attention=True, qk_layernorm=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim, qk_pos_emb_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
        kv_channels=m.v_head_dim, rotary_base=rope.theta, rotary_percent=1.0,
        rope_type="yarn" if rope.kind == "yarn" else "rope",
        # megatron-core's MLA scales softmax by YaRN's mscale_all_dim term whenever the factor is > 1
        rotary_scaling_factor=rope.factor if rope.kind == "yarn" else 1.0,
        mscale=rope.mscale or 1.0, mscale_all_dim=rope.mscale_all_dim or 0.0,
        beta_fast=rope.beta_fast, beta_slow=rope.beta_slow,
    )
    original = "original_max_position_embeddings"  # 0.13 named it max_position_embeddings
    names = {f.name for f in fields(MLATransformerConfig)}
    values[original if original in names else "max_position_embeddings"] = rope.original_max_positions or 4096
    return values


def refuse_unbuildable(arch: HFArchitecture) -> None:
    """What this megatron-core's MLA builds otherwise than transformers, refused by version:
    0.13.1 scales the softmax by YaRN's `mscale` where transformers (and 0.16.1, 0.19.2) use
    `mscale_all_dim` (0.4 apart in log-probs on a tiny model; 0.14 / 0.15 unchecked, refused with
    it); 0.19's MLA wants queries without a low-rank step normalized by a fused Transformer Engine
    norm + linear, which the local spec has not."""
    from megatron.core.package_info import __version__

    release = tuple(ascii_int(part) or 0 for part in __version__.split(".")[:2])
    if arch.rope.kind == "yarn" and release < (0, 16):
        raise UnsupportedCheckpointError(
            f"{arch.source}: YaRN with multi-latent attention on megatron-core {__version__}, whose MLA scales the "
            "softmax by mscale instead of mscale_all_dim (checked on 0.13.1); use megatron-core >= 0.16"
        )
    if arch.mla.q_lora_rank is None and importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config"):
        raise UnsupportedCheckpointError(
            f"{arch.source}: q_lora_rank=null (queries without a low-rank step, as Moonlight's) on megatron-core "
            f"{__version__}, whose MLA then builds the query projection as a Transformer Engine fused norm + "
            "linear only (checked on 0.19.2); use megatron-core 0.16 or pass a Transformer Engine build"
        )


def sdpa_core_attention(arch: HFArchitecture) -> type:
    """The attention core MLA runs on where no other is given (megatron-core's local one cannot)."""
    # lazy: import cost: memory --hf plans without torch (sdpa_attention imports it)
    from megatron_rl_patches.inference.sdpa_attention import SDPACoreAttention

    return SDPACoreAttention


def mla_spec(arch: HFArchitecture) -> Any:
    """megatron-core's local GPT layer spec with MLASelfAttention (every layer alike: dense, or MoE)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    disarm_mocked_te_in_mla()
    spec = get_gpt_layer_local_spec(num_experts=arch.num_experts or None, moe_grouped_gemm=False, qk_layernorm=True,
                                    multi_latent_attention=True, normalization="RMSNorm")
    attention = spec.submodules.self_attention.submodules
    if arch.mla.q_lora_rank is None:  # no query latent to normalize (0.19 refuses a norm it would not use)
        from megatron.core.transformer.identity_op import IdentityOp

        attention.q_layernorm = IdentityOp
    return spec


def disarm_mocked_te_in_mla() -> None:
    """Without Transformer Engine, megatron-core 0.16's MLA module believes TE present (its import
    of the TE extension succeeds with MagicMock classes) and calls isinstance against a MagicMock
    TELinear, a TypeError: where TELinear is no class, the module's HAVE_TE is made False."""
    from megatron.core.transformer import multi_latent_attention as module

    if getattr(module, "HAVE_TE", False) and not isinstance(getattr(module, "TELinear", None), type):
        module.HAVE_TE = False


def mla_config_class(arch: HFArchitecture) -> type:
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig
