"""Hugging Face tensors -> megatron-core local-spec parameters: which HF tensors make each
Megatron parameter (the family's parameter map), how they are fused (q/k/v interleaved per query
group, gate and up stacked into linear_fc1) and which shard this rank holds (tensor, pipeline and
expert parallel)."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture
from megatron_rl_patches.inference.loading.hf.families import family_for, mla
from megatron_rl_patches.inference.loading.hf.families.family import EXPERT, Family
from megatron_rl_patches.inference.loading.hf.families.hybrid_layout import (
    gated_qkv,
    linear_conv,
    linear_in_proj,
    unfuse_qkvz_ba,
)

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Source:
    """The HF tensors of one Megatron parameter, their fusion, and the shard this rank holds."""

    hf_names: tuple[str, ...]
    kind: str  # one of family.KINDS
    expert: bool  # sharded over the expert tensor-parallel group


def _template(name: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(name).replace(re.escape(EXPERT), r"(\d+)") + "$")


def source(arch: HFArchitecture, key: str, layer_numbers: dict[int, int], ep_offset: int,
           family: Family | None = None) -> Source:
    """Where the local-spec state-dict entry `key` comes from; `layer_numbers` maps this chunk's
    layer index to the global one, `ep_offset` is this rank's first expert."""
    family = family or family_for(arch.model_type, arch.source)
    outer = family.outer_params(arch).get(key)
    if outer is not None:
        return Source(outer.hf, outer.kind, False)
    match = _LAYER_KEY.match(key)
    if match is not None:
        layer = layer_numbers[int(match.group(1))]
        prefix, rest = family.layer_prefix.format(layer=layer), match.group(2)
        for name, param in family.layer_params(arch, layer).items():
            if not param.expert:
                if name == rest:
                    return Source(tuple(prefix + hf for hf in param.hf), param.kind, False)
                continue
            expert = _template(name).match(rest)
            if expert is not None:
                number = str(ep_offset + int(expert.group(1)))
                return Source(tuple(prefix + hf.replace(EXPERT, number) for hf in param.hf), param.kind, True)
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
        "column": lambda: tensors[0].chunk(size, dim=0)[rank],
        "mla_q": lambda: mla.query_rows(arch, tensors[0]).chunk(size, dim=0)[rank],
        "mla_kv_down": lambda: mla.kv_down_rows(arch, tensors[0]).chunk(size, dim=0)[rank],
        "gated": lambda: torch.cat([t.chunk(size, dim=0)[rank] for t in tensors], dim=0),
        "qkv": lambda: _qkv(arch, *tensors).chunk(size, dim=0)[rank],
        "vocab": lambda: _pad_rows(tensors[0], padded_vocab).chunk(size, dim=0)[rank],
        "centred": lambda: tensors[0] + 1,  # (1 + w) x^ as megatron's w x^: exact
        "gated_qkv": lambda: gated_qkv(arch, *tensors).chunk(size, dim=0)[rank],
        "gdn_in": lambda: linear_in_proj(arch, *tensors, rank=rank, size=size),
        "gdn_in_fused": lambda: linear_in_proj(arch, *unfuse_qkvz_ba(arch, *tensors), rank=rank, size=size),
        "gdn_conv": lambda: linear_conv(arch, tensors[0], rank, size),
    }
    return fuse[src.kind]()


def _pad_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """Megatron's padded vocab: zero rows after the real ids (never given probability mass by the
    ops when they are told the real vocab_size)."""
    if table.shape[0] == rows:
        return table
    return torch.cat([table, table.new_zeros(rows - table.shape[0], *table.shape[1:])], dim=0)
