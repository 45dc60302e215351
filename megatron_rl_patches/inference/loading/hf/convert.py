"""Hugging Face tensors -> megatron-core local-spec parameters: which HF tensors make each
Megatron parameter (the family's parameter map) and which shard this rank holds (tensor, pipeline
and expert parallel); how they are fused is the parameter's fuse kind's (families/fuse_kind.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture
from megatron_rl_patches.inference.loading.hf.families.family import EXPERT, Family
from megatron_rl_patches.inference.loading.hf.families.fuse_kind import FuseKind, Piece, Pieces, fuse_kind

__all__ = ["Piece", "Source", "shard_pieces", "source"]  # Piece: defined here before the kinds were objects
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Source:
    """The HF tensors of one Megatron parameter, their fusion, and the shard this rank holds."""

    hf_names: tuple[str, ...]
    kind: FuseKind  # (or a registered kind's name)
    expert: bool  # sharded over the expert tensor-parallel group

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", fuse_kind(self.kind))


def _template(name: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(name).replace(re.escape(EXPERT), r"(\d+)") + "$")


def source(arch: HFArchitecture, key: str, layer_numbers: dict[int, int], ep_offset: int,
           family: Family | None = None) -> Source:
    """Where the local-spec state-dict entry `key` comes from; `layer_numbers` maps this chunk's
    layer index to the global one, `ep_offset` is this rank's first expert."""
    family = family or arch.family
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


def shard_pieces(arch: HFArchitecture, src: Source, tensors: list[torch.Tensor], rank: int, size: int,
                 padded_vocab: int) -> Pieces:
    """This rank's part (`rank` of `size` in its tensor-parallel group) of the fused parameter: its
    shape, and the slices of the target each source slice is copied into (a value None: zeros), so
    that the fused parameter is never made as a tensor of its own. Its fuse kind fills it."""
    return src.kind.shard(arch, tensors, rank, size, padded_vocab)
