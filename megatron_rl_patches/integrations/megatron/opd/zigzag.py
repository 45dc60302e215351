"""megatron-core's context-parallel zigzag for whole responses: per sample, each context-parallel
rank holds its zigzag rows of the response (megatron-core's `thd` split, as slime keeps per-sample
fields); the teachers read whole responses (`whole_from_zigzag`: one SUM over the
context-parallel group) and hand back each rank's rows (`zigzag_of_whole`: no communication).
Both unchanged with one context-parallel rank.

Under allgather context parallelism (slime's `--allgather-cp`) a rank runs the model on a contiguous
slice of the packed stream while the per-sample fields stay in its zigzag rows: a pass's contiguous
rows go to the zigzag rows (`zigzag_from_local`) and per-sample zigzag values to a pass's contiguous
rows (`local_from_zigzag`, `local_rows`), by the ops' row moves (`ops.packing`: one SUM over the
context-parallel group); `local_spans` says which response rows a contiguous slice holds."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.ops.packing import (
    PackedLayout,
    allgather_cp_to_zigzag,
    response_pieces,
    zigzag_to_allgather_cp,
)


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


def local_spans(local_len: int, total_lengths: list[int], response_lengths: list[int]) -> list[tuple[int, int]]:
    """Per sample, the [start, end) of its response rows this rank's contiguous slice holds (the
    rows slime's `_extract_per_sample` cuts with --allgather-cp; its top-p replay maps its nuclei by them)."""
    from megatron.core import parallel_state

    chunk_start = parallel_state.get_context_parallel_rank() * local_len
    chunk_end, spans, seq_start = chunk_start + local_len, [], 0
    for total, response in zip(total_lengths, response_lengths):
        first = seq_start + total - response - 1  # the stream row whose logits give the first response token
        start, end = max(first, chunk_start), min(first + response, chunk_end)
        spans.append((start - first, end - first) if end > start else (0, 0))
        seq_start += total
    return spans


def _cp_layout(local_len: int, total_lengths: list[int], response_lengths: list[int]) -> dict[str, Any]:
    """The layout, rows and group arguments of the ops' row moves for this context-parallel rank."""
    from megatron.core import parallel_state

    layout = PackedLayout(tuple(total_lengths), tuple(response_lengths),
                          cp_size=parallel_state.get_context_parallel_world_size(),
                          cp_rank=parallel_state.get_context_parallel_rank(), allgather_cp=True)
    return {"layout": layout, "num_rows": local_len, "group": parallel_state.get_context_parallel_group()}


def zigzag_from_local(pieces: list[torch.Tensor], local_len: int, total_lengths: list[int],
                      response_lengths: list[int]) -> list[torch.Tensor]:
    """Per sample, the zigzag rows of per-token values a pass gave on this rank's contiguous rows
    (`pieces`: per sample, [rows held, ...]); gradients flow back to every rank's piece when the
    pieces require grad (slime's redistribution of log-probs does the same)."""
    return allgather_cp_to_zigzag(pieces, **_cp_layout(local_len, total_lengths, response_lengths))


def local_from_zigzag(per_sample: list[torch.Tensor], local_len: int, total_lengths: list[int],
                      response_lengths: list[int]) -> list[torch.Tensor]:
    """Per sample, the rows of this rank's contiguous slice from per-sample zigzag values (the
    rollout data's ids and masks)."""
    return zigzag_to_allgather_cp(per_sample, **_cp_layout(local_len, total_lengths, response_lengths))


def local_rows(batch: dict, length: int, ids: list[torch.Tensor],
               masks: list[torch.Tensor] | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-sample ids (and masks) kept in zigzag rows (slime's rollout data keeps them so), on the
    contiguous rows of this rank's slice under allgather CP (unchanged with one context-parallel rank)."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() == 1:
        return ids, masks

    lengths = (batch["total_lengths"], batch["response_lengths"])
    return (local_from_zigzag(ids, length, *lengths),
            None if masks is None else local_from_zigzag(masks, length, *lengths))
