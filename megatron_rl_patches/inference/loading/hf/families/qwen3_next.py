"""Qwen3-Next (`model_type` qwen3_next): Qwen3.5-MoE's layers (families/qwen3_5.py) with the
linear-attention projections fused per key head: `in_proj_qkvz` holds per key head its query, key,
values and gates, `in_proj_ba` its write strengths and decays; unfused at load into megatron-core's
in_proj layout (its fuse kind `GDN_IN_FUSED`, below). The top-k weights are renormalized where
`norm_topk_prob` (default true)."""
# lazy imports: import cost: memory --hf plans without torch (a fill's hybrid_layout / views import it)
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture
from megatron_rl_patches.inference.loading.hf.families import qwen3_5
from megatron_rl_patches.inference.loading.hf.families.family import Param, Shape
from megatron_rl_patches.inference.loading.hf.families.fuse_kind import FuseKind, Pieces, register

if TYPE_CHECKING:
    import torch


class GdnInFused(FuseKind):
    """The gated delta net's in_proj from in_proj_qkvz and in_proj_ba, taken apart per key head
    (hybrid_layout.unfuse_qkvz_ba), then laid out as Qwen3.5's four projections are."""

    name, arity = "gdn_in_fused", 2

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        from megatron_rl_patches.inference.loading.hf.families.hybrid_layout import linear_in_proj, unfuse_qkvz_ba
        from megatron_rl_patches.inference.loading.hf.families.views import fused_rows, whole

        return whole(fused_rows(lambda *x: linear_in_proj(arch, *unfuse_qkvz_ba(arch, *x), rank=rank, size=size),
                                tensors))


GDN_IN_FUSED = register(GdnInFused())


def linear_attention_tensors(arch: HFArchitecture) -> dict[str, Shape]:
    m, h = arch.linear, arch.hidden_size
    return {"linear_attn.in_proj_qkvz.weight": (2 * m.key_width + 2 * m.value_width, h),
            "linear_attn.in_proj_ba.weight": (2 * m.value_heads, h), **qwen3_5.linear_attention_common_tensors(arch)}


def layer_tensors(arch: HFArchitecture, layer: int) -> dict[str, Shape]:
    if arch.layer_types[layer] == qwen3_5.FULL:
        return qwen3_5.layer_tensors(arch, layer)
    h = arch.hidden_size
    return {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            **linear_attention_tensors(arch), **qwen3_5.mlp_tensors(arch)}


def layer_params(arch: HFArchitecture, layer: int) -> dict[str, Param]:
    if arch.layer_types[layer] == qwen3_5.FULL:
        return qwen3_5.layer_params(arch, layer)
    fused = Param(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"), GDN_IN_FUSED)
    return {**qwen3_5.NORMS, "self_attention.in_proj.weight": fused, **qwen3_5.linear_attention_common_params(),
            **qwen3_5.mlp_params(arch)}


FAMILY = replace(qwen3_5.MOE_TEXT_FAMILY, name="qwen3_next", hf_class="Qwen3Next", layer_tensors=layer_tensors,
                 layer_params=layer_params, tiny_fields={**qwen3_5.TINY_MOE, "norm_topk_prob": True},
                 stacked_experts=False,  # Qwen3-Next's checkpoints store each expert apart
                 fields=qwen3_5.HYBRID_MOE | {"norm_topk_prob", "mlp_only_layers", "decoder_sparse_step"})
