"""The MoE records a host replays for a micro-batch, as its sharing plan reads them
(`plan_shared_prefix(..., routed_experts=)`): each rank holds its own, the whole micro-batch's rows
or (under sequence parallelism) its share of them, and the plan needs the whole micro-batch's on
every rank of the tensor-parallel group, which builds one plan. What each rank holds is agreed over
the group before the gather, so a rank without records, or with records of other rows, packs the
micro-batch whole on every rank alike (never one rank gathering while another waits)."""
from __future__ import annotations

import zlib
from typing import Any

import torch

from megatron_rl_patches.ops.agreement import agreed_range, gathered

NONE, WHOLE, SHARE, OTHER = 0, 1, 2, 3  # what a rank holds: no records, the whole rows, its share, neither


def _held(local: Any, tokens: int, ranks: int) -> int:
    if local is None:
        return NONE
    if not isinstance(local, (list, tuple)) or not local or not all(isinstance(t, torch.Tensor) and t.dim() >= 1
                                                                    for t in local):
        return OTHER
    rows = {int(t.shape[0]) for t in local}
    if rows == {tokens}:
        return WHOLE
    if ranks > 1 and rows == {tokens // ranks} and tokens % ranks == 0:
        return SHARE
    return OTHER


def whole_records(local: Any, tokens: int, group: Any) -> list[torch.Tensor] | None | str:
    """The whole micro-batch's records on every rank of `group` (the tensor-parallel group), from this rank's
    `local` (a list of each MoE layer's [rows, topk]; None: no records held; a str: why they cannot be
    read): None where no rank holds any (a pass that records, or routes as its router picks), a str
    (why the micro-batch packs whole) where the ranks disagree or one cannot read them."""
    ranks = torch.distributed.get_world_size(group) if group is not None and torch.distributed.is_initialized() else 1
    mine = _held(local, tokens, ranks)
    if mine in (WHOLE, SHARE):  # the gather's shapes agreed too: layers, each record's width and dtype
        layout = repr([(tuple(t.shape[1:]), str(t.dtype)) for t in local]).encode()
        mine += 4 * (zlib.crc32(layout) & 0x3FFFFFFF)
    low, high = agreed_range(group, mine)
    held = high % 4  # what every rank holds, where they all hold it alike
    if low != high or held == OTHER:
        return local if isinstance(local, str) else ("records of the replayed MoE routes that are not the "
                                                     "micro-batch's rows on every tensor-parallel rank")
    if held == NONE:
        return None
    if held == WHOLE:
        return [t.detach() for t in local]
    return [torch.cat(gathered(group, t.detach().contiguous()), dim=0) for t in local]
