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


Piece = tuple[Callable[[torch.Tensor], torch.Tensor], "torch.Tensor | None"]  # (where in the target, value)


def shard_pieces(arch: HFArchitecture, src: Source, tensors: list[torch.Tensor], rank: int, size: int,
                 padded_vocab: int) -> tuple[tuple[int, ...], list[Piece]]:
    """This rank's part (`rank` of `size` in its tensor-parallel group) of the fused parameter: its
    shape, and the slices of the target each source slice is copied into (a value None: zeros), so
    that the fused parameter is never made as a tensor of its own."""
    t = tensors[0]
    if src.kind == "gated":
        return _stacked([part.chunk(size, dim=0)[rank] for part in tensors])
    if src.kind == "qkv":
        return _qkv_pieces(arch, *tensors, rank=rank, size=size)
    if src.kind == "vocab":
        return _vocab_pieces(t, padded_vocab, rank, size)
    value = {
        "replicate": lambda: t,
        "row": lambda: t.chunk(size, dim=1)[rank],
        "column": lambda: t.chunk(size, dim=0)[rank],
        "mla_q": lambda: _rows_in_order(t, mla.query_rows(arch, _row_numbers(t)), rank, size),
        "mla_kv_down": lambda: _rows_in_order(t, mla.kv_down_rows(arch, _row_numbers(t)), rank, size),
        "centred": lambda: t + 1,  # (1 + w) x^ as megatron's w x^: exact
        "gated_qkv": lambda: _fused_rows(lambda *x: gated_qkv(arch, *x).chunk(size, dim=0)[rank], tensors),
        "gdn_in": lambda: _fused_rows(lambda *x: linear_in_proj(arch, *x, rank=rank, size=size), tensors),
        "gdn_in_fused": lambda: _fused_rows(
            lambda *x: linear_in_proj(arch, *unfuse_qkvz_ba(arch, *x), rank=rank, size=size), tensors),
        "gdn_conv": lambda: _fused_rows(lambda x: linear_conv(arch, x, rank, size), tensors),
    }[src.kind]()
    return tuple(value.shape), [(lambda target: target, value)]


def _row_numbers(t: torch.Tensor) -> torch.Tensor:
    return torch.arange(t.shape[0]).unsqueeze(-1)  # a column the row reorders move like the rows of `t`


def _rows_in_order(t: torch.Tensor, order: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's rows of `t` reordered by `order` (the reordered row numbers), reading only the
    span of rows of `t` they lie in, not the whole tensor."""
    mine = order.reshape(-1).chunk(size)[rank]
    low, high = int(mine.min()), int(mine.max()) + 1
    return t[low:high].index_select(0, mine - low)


def _fused_rows(rows_of: Callable[..., torch.Tensor], tensors: list[torch.Tensor]) -> torch.Tensor:
    """`rows_of(*tensors)` for a `rows_of` that only picks and orders whole rows of its inputs,
    reading only the rows it picks: it is run on row labels first ((row, input) in one integer), then
    each run of consecutive rows of one input is sliced from it (a view) and the runs concatenated."""
    n = len(tensors)
    labels = rows_of(*[(torch.arange(t.shape[0]) * n + i).unsqueeze(-1) for i, t in enumerate(tensors)]).reshape(-1)
    which, row = labels % n, labels // n
    breaks = ((which[1:] != which[:-1]) | (row[1:] != row[:-1] + 1)).nonzero().reshape(-1) + 1
    starts = [0, *breaks.tolist()]
    stops = [*breaks.tolist(), labels.numel()]
    return torch.cat([tensors[int(which[a])][int(row[a]):int(row[a]) + b - a] for a, b in zip(starts, stops)])


def _rows(start: int, stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda target: target[start:stop]


def _stacked(parts: list[torch.Tensor]) -> tuple[tuple[int, ...], list[Piece]]:
    """`parts` one after another along the rows."""
    pieces: list[Piece] = []
    start = 0
    for part in parts:
        pieces.append((_rows(start, start + part.shape[0]), part))
        start += part.shape[0]
    return (start, *parts[0].shape[1:]), pieces


def _qkv(arch: HFArchitecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's fused layout: per query group, its query heads then its key and its value head."""
    groups, hd = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]
    per_group = [q.reshape(groups, -1, *tail), k.reshape(groups, hd, *tail), v.reshape(groups, hd, *tail)]
    return torch.cat(per_group, dim=1).reshape(-1, *tail)


def _qkv_pieces(arch: HFArchitecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rank: int,
                size: int) -> tuple[tuple[int, ...], list[Piece]]:
    """Megatron's fused qkv of this rank's query groups, written block by block into the target seen
    as [groups, rows per group, ...]."""
    groups, hd = arch.num_kv_heads, arch.head_dim
    if groups % size:  # a rank's rows cut through a group: fuse, then take them
        value = _qkv(arch, q, k, v).chunk(size, dim=0)[rank]
        return tuple(value.shape), [(lambda target: target, value)]
    local, tail = groups // size, tuple(q.shape[1:])
    mine = slice(rank * local, (rank + 1) * local)
    blocks = [q.reshape(groups, -1, *tail)[mine], k.reshape(groups, hd, *tail)[mine],
              v.reshape(groups, hd, *tail)[mine]]
    per_group = sum(block.shape[1] for block in blocks)
    pieces: list[Piece] = []
    start = 0
    for block in blocks:
        pieces.append((_group_columns(local, per_group, tail, start, start + block.shape[1]), block))
        start += block.shape[1]
    return (local * per_group, *tail), pieces


def _group_columns(groups: int, per_group: int, tail: tuple[int, ...], start: int,
                   stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows start:stop of every group of a target seen as [groups, per_group, ...]."""
    return lambda target: target.view(groups, per_group, *tail)[:, start:stop]


def _vocab_pieces(table: torch.Tensor, padded: int, rank: int, size: int) -> tuple[tuple[int, ...], list[Piece]]:
    """This rank's rows of Megatron's padded vocab: zero rows after the real ids (never given
    probability mass by the ops when they are told the real vocab_size)."""
    per_rank = -(-padded // size)  # as torch.chunk cuts
    start, stop = min(rank * per_rank, padded), min((rank + 1) * per_rank, padded)
    real = max(0, min(stop, table.shape[0]) - start)
    pieces: list[Piece] = [(_rows(0, real), table[start:start + real])]
    if real < stop - start:
        pieces.append((_rows(real, stop - start), None))
    return (stop - start, *table.shape[1:]), pieces
