"""Mixtral (`model_type` mixtral): Llama's attention (no biases, no q/k norm) and in every layer a
top-k softmax router over SwiGLU experts as wide as `intermediate_size`, renormalized, under
`block_sparse_moe.` (w1 gate, w3 up, w2 down); sliding-window attention is refused."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture, decoder_architecture, read_count
from megatron_rl_patches.inference.loading.hf.families.common import attention_params, attention_tensors, moe_config
from megatron_rl_patches.inference.loading.hf.families.common_kinds import GATED, REPLICATE, ROW
from megatron_rl_patches.inference.loading.hf.families.family import Family, Param, Shape

MOE, EXPERT = "block_sparse_moe.", "block_sparse_moe.experts.{e}."


def read(config: dict[str, Any], source: str) -> HFArchitecture:
    window = config.get("sliding_window")
    refused = [f"sliding_window={window!r} (full attention only)"] if window else []
    arch = decoder_architecture(config, source, qkv_bias=False, qk_norm=False, moe=False, refused=refused)
    experts, per_token = (read_count(config, source, name) for name in ("num_local_experts", "num_experts_per_tok"))
    if per_token > experts:  # it built, then the router's topk failed at the first forward
        raise ValueError(f"{source}: config.json's num_experts_per_tok={per_token} exceeds "
                         f"num_local_experts={experts}; a token is routed to at most every expert")
    return replace(arch, num_experts=experts, experts_per_token=per_token,
                   expert_ffn_hidden_size=arch.ffn_hidden_size, norm_topk_prob=True)


def layer_tensors(arch: HFArchitecture, layer: int) -> dict[str, Shape]:
    h, f = arch.hidden_size, arch.expert_ffn_hidden_size
    return {**attention_tensors(arch), MOE + "gate.weight": (arch.num_experts, h),
            EXPERT + "w1.weight": (f, h), EXPERT + "w3.weight": (f, h), EXPERT + "w2.weight": (h, f)}


def layer_params(arch: HFArchitecture, layer: int) -> dict[str, Param]:
    local = "mlp.experts.local_experts.{e}."
    return {**attention_params(arch), "mlp.router.weight": Param((MOE + "gate.weight",), REPLICATE),
            local + "linear_fc1.weight": Param((EXPERT + "w1.weight", EXPERT + "w3.weight"), GATED),
            local + "linear_fc2.weight": Param((EXPERT + "w2.weight",), ROW)}


FAMILY = Family(
    name="mixtral", hf_class="Mixtral", read=read, layer_tensors=layer_tensors, layer_params=layer_params,
    config_overrides=moe_config, fields=frozenset({"sliding_window", "num_local_experts", "num_experts_per_tok",
                                                       "num_experts"}),
    synonyms=(("num_local_experts", "num_experts"),),
    tiny_fields={"num_local_experts": 4, "num_experts_per_tok": 2},
)
