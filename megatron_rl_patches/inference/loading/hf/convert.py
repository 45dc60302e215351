"""Hugging Face tensors -> megatron-core local-spec parameters: which HF tensors make each
Megatron parameter, how they are fused (q/k/v interleaved per query group, gate and up stacked
into linear_fc1) and which shard this rank holds (tensor, pipeline and expert parallel)."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture

_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

# local-spec parameter of one layer -> (HF tensor suffixes, how they make the parameter)
_LAYER = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicate"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicate"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv"),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicate"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicate"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gated"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
    "mlp.router.weight": (("mlp.gate.weight",), "replicate"),
}


@dataclass(frozen=True)
class Source:
    """The HF tensors of one Megatron parameter, their fusion, and the shard this rank holds."""

    hf_names: tuple[str, ...]
    kind: str  # replicate | row | gated | qkv | vocab
    expert: bool  # sharded over the expert tensor-parallel group


def source(arch: HFArchitecture, key: str, layer_numbers: dict[int, int], ep_offset: int) -> Source:
    """Where the local-spec state-dict entry `key` comes from; `layer_numbers` maps this chunk's
    layer index to the global one, `ep_offset` is this rank's first expert."""
    if key == "embedding.word_embeddings.weight":
        return Source(("model.embed_tokens.weight",), "vocab", False)
    if key == "output_layer.weight":
        return Source(("model.embed_tokens.weight" if arch.tied else "lm_head.weight",), "vocab", False)
    if key == "decoder.final_layernorm.weight":
        return Source(("model.norm.weight",), "replicate", False)
    match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", key)
    if match is not None:
        prefix = f"model.layers.{layer_numbers[int(match.group(1))]}."
        rest = match.group(2)
        if rest in _LAYER:
            suffixes, kind = _LAYER[rest]
            return Source(tuple(prefix + s for s in suffixes), kind, False)
        expert = _EXPERT.match(rest)
        if expert is not None:
            e_prefix = f"{prefix}mlp.experts.{ep_offset + int(expert.group(1))}."
            if expert.group(2) == "linear_fc1":
                return Source((e_prefix + "gate_proj.weight", e_prefix + "up_proj.weight"), "gated", True)
            return Source((e_prefix + "down_proj.weight",), "row", True)
    raise KeyError(
        f"no Hugging Face tensor maps to the Megatron parameter {key!r} of a {arch.model_type} model; "
        "this build is not the converter's (report it with the config.json)"
    )


def _qkv(arch: HFArchitecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's fused layout: per query group, its query heads then its key and its value head."""
    groups, hd = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]
    per_group = [q.reshape(groups, -1, *tail), k.reshape(groups, hd, *tail), v.reshape(groups, hd, *tail)]
    return torch.cat(per_group, dim=1).reshape(-1, *tail)


def shard(arch: HFArchitecture, src: Source, tensors: list[torch.Tensor], rank: int, size: int,
          padded_vocab: int) -> torch.Tensor:
    """This rank's part (`rank` of `size` in its tensor-parallel group) of the fused parameter."""
    fuse: dict[str, Callable[[], torch.Tensor]] = {
        "replicate": lambda: tensors[0],
        "row": lambda: tensors[0].chunk(size, dim=1)[rank],
        "gated": lambda: torch.cat([t.chunk(size, dim=0)[rank] for t in tensors], dim=0),
        "qkv": lambda: _qkv(arch, *tensors).chunk(size, dim=0)[rank],
        "vocab": lambda: _pad_rows(tensors[0], padded_vocab).chunk(size, dim=0)[rank],
    }
    return fuse[src.kind]()


def _pad_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """Megatron's padded vocab: zero rows after the real ids (never given probability mass by the
    ops when they are told the real vocab_size)."""
    if table.shape[0] == rows:
        return table
    return torch.cat([table, table.new_zeros(rows - table.shape[0], *table.shape[1:])], dim=0)
