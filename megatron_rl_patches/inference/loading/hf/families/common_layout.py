"""The layouts of the common fuse kinds that are more than a chunk (families/common_kinds.py):
q/k/v fused per query group (Megatron's linear_qkv), and the vocabulary padded to Megatron's size."""
from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture
from megatron_rl_patches.inference.loading.hf.families.fuse_kind import Piece, Pieces
from megatron_rl_patches.inference.loading.hf.families.kv_heads import kv_repeat
from megatron_rl_patches.inference.loading.hf.families.views import rows, whole


def qkv(arch: HFArchitecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's fused layout: per query group, its query heads then its key and its value head."""
    groups, hd = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]
    per_group = [q.reshape(groups, -1, *tail), k.reshape(groups, hd, *tail), v.reshape(groups, hd, *tail)]
    return torch.cat(per_group, dim=1).reshape(-1, *tail)


def qkv_pieces(arch: HFArchitecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rank: int,
               size: int) -> Pieces:
    """Megatron's fused qkv of this rank's query groups, written block by block into the target seen
    as [groups, rows per group, ...]; where `size` exceeds the key/value heads, the rank's one group
    with its key/value head, repeated over the ranks (kv_heads.py)."""
    heads, hd = arch.num_kv_heads, arch.head_dim
    repeat = kv_repeat(arch, size)  # > 1: size groups, one per rank, each of key/value head rank // repeat
    groups = heads * repeat
    if groups % size:  # a rank's rows cut through a group: fuse, then take them
        return whole(qkv(arch, q, k, v).chunk(size, dim=0)[rank])
    local, tail = groups // size, tuple(q.shape[1:])
    mine = slice(rank * local, (rank + 1) * local)
    kv = slice(mine.start // repeat, (mine.stop - 1) // repeat + 1)  # the heads of the rank's groups (read once)
    blocks = [q.reshape(groups, -1, *tail)[mine], k.reshape(heads, hd, *tail)[kv], v.reshape(heads, hd, *tail)[kv]]
    per_group = sum(block.shape[1] for block in blocks)
    pieces: list[Piece] = []
    start = 0
    for block in blocks:
        pieces.append((_group_rows(local, per_group, tail, start, start + block.shape[1]), block))
        start += block.shape[1]
    return (local * per_group, *tail), pieces


def _group_rows(groups: int, per_group: int, tail: tuple[int, ...], start: int,
                stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows start:stop of every group of a target seen as [groups, per_group, ...]."""
    return lambda target: target.view(groups, per_group, *tail)[:, start:stop]


def vocab_pieces(table: torch.Tensor, padded: int, rank: int, size: int) -> Pieces:
    """This rank's rows of Megatron's padded vocab: zero rows after the real ids (never given
    probability mass by the ops when they are told the real vocab_size)."""
    per_rank = -(-padded // size)  # as torch.chunk cuts
    start, stop = min(rank * per_rank, padded), min((rank + 1) * per_rank, padded)
    real = max(0, min(stop, table.shape[0]) - start)
    pieces: list[Piece] = [(rows(0, real), table[start:start + real])]
    if real < stop - start:
        pieces.append((rows(real, stop - start), None))
    return (stop - start, *table.shape[1:]), pieces
