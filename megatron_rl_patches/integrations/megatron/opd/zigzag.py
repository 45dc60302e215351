"""megatron-core's context-parallel zigzag for whole responses: per sample, each context-parallel
rank holds its zigzag rows of the response (megatron-core's `thd` split, as slime keeps per-sample
fields); the teachers read whole responses (`whole_from_zigzag`: one SUM over the
context-parallel group) and hand back each rank's rows (`zigzag_of_whole`: no communication).
Both unchanged with one context-parallel rank."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.ops.packing import PackedLayout, response_pieces


def _zigzag_pieces(total_lengths: list[int], response_lengths: list[int]) -> list[list[Any]] | None:
    """Per sample, this context-parallel rank's runs of the response (`ops.packing.Piece`s, in
    response order); None with one context-parallel rank."""
    from megatron.core import parallel_state

    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size == 1:
        return None
    layout = PackedLayout(tuple(total_lengths), tuple(response_lengths), cp_size=cp_size,
                          cp_rank=parallel_state.get_context_parallel_rank())
    return response_pieces(layout, sum(layout.sample_rows(t) for t in total_lengths))


def whole_from_zigzag(per_sample: list[torch.Tensor], total_lengths: list[int],
                      response_lengths: list[int]) -> list[torch.Tensor]:
    """Per sample, the whole response's values from each context-parallel rank's zigzag rows (every
    rank gets them all, as plain values: one SUM over the context-parallel group; unchanged with one
    context-parallel rank)."""
    from megatron.core import parallel_state

    pieces = _zigzag_pieces(total_lengths, response_lengths) if per_sample else None
    if pieces is None:
        return list(per_sample)
    if per_sample[0].dtype == torch.bool:  # a SUM of bools is not every backend's; each row is set on one rank
        return [whole != 0 for whole in whole_from_zigzag([v.to(torch.int32) for v in per_sample],
                                                          total_lengths, response_lengths)]
    full = []
    for values, held, response in zip(per_sample, pieces, response_lengths):
        whole = values.new_zeros((response, *values.shape[1:]))
        row = 0
        for piece in held:  # this rank's runs of the response, in response order
            rows = piece.stop - piece.start
            whole[piece.offset:piece.offset + rows] = values[row:row + rows].detach()
            row += rows
        full.append(whole)
    summed = torch.cat(full)
    dist.all_reduce(summed, group=parallel_state.get_context_parallel_group())
    return list(summed.split(list(response_lengths)))


def zigzag_of_whole(per_sample: list[torch.Tensor], total_lengths: list[int],
                    response_lengths: list[int]) -> list[torch.Tensor]:
    """Per sample, this context-parallel rank's zigzag rows of whole-response values (as slime keeps
    per-sample fields: `whole_from_zigzag`'s inverse, no communication; unchanged with one
    context-parallel rank)."""
    pieces = _zigzag_pieces(total_lengths, response_lengths) if per_sample else None
    if pieces is None:
        return list(per_sample)
    return [torch.cat([whole[piece.offset:piece.offset + piece.stop - piece.start] for piece in held])
            if held else whole[:0] for whole, held in zip(per_sample, pieces)]
