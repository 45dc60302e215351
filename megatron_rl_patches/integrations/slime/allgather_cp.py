"""slime's `--allgather-cp` (624b824a) for top-k OPD: each context-parallel rank runs the model on
a contiguous slice of the packed stream, while slime keeps every per-sample field of its rollout
data (log-probs, advantages, masks) in the zigzag rows of the rank (its
`_allgather_cp_redistribute`). Top-k OPD's [R, k] ids and buckets follow the same rule: a pass's
contiguous rows go to the zigzag rows for the rollout data (`zigzag_from_local`), and the rollout's
ids go back to the contiguous rows of a pass (`local_from_zigzag`). Each is one sum over the
context-parallel group (slime's own redistribution is the same all-reduce)."""
from __future__ import annotations

from typing import Any

import torch


def allgather_cp_active(args: Any) -> bool:
    """Whether slime's `--allgather-cp` is on with more than one context-parallel rank."""
    if not getattr(args, "allgather_cp", False):
        return False
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size() > 1


def local_spans(local_len: int, total_lengths: list[int], response_lengths: list[int]) -> list[tuple[int, int]]:
    """Per sample, the [start, end) of its response rows this rank's contiguous slice holds (the
    rows `_extract_per_sample` cuts with --allgather-cp; top-p replay maps its nuclei by them)."""
    from megatron.core import parallel_state

    chunk_start = parallel_state.get_context_parallel_rank() * local_len
    chunk_end, spans, seq_start = chunk_start + local_len, [], 0
    for total, response in zip(total_lengths, response_lengths):
        first = seq_start + total - response - 1  # the stream row whose logits give the first response token
        start, end = max(first, chunk_start), min(first + response, chunk_end)
        spans.append((start - first, end - first) if end > start else (0, 0))
        seq_start += total
    return spans


def zigzag_rows(total: int, response: int) -> torch.Tensor:
    """The response rows (of [0, R)) this rank holds in slime's zigzag layout, in its order."""
    from slime.backends.megatron_utils.cp_utils import get_logits_and_tokens_offset_with_cp

    _, _, logits_offset, _ = get_logits_and_tokens_offset_with_cp(total, response)
    first = total - response - 1
    return torch.cat([torch.arange(lo - first, hi - first) for lo, hi in logits_offset])


def _cp_sum(tensor: torch.Tensor, differentiable: bool) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    if tensor.dtype == torch.bool:
        return _cp_sum(tensor.to(torch.int32), differentiable=False) > 0
    if differentiable:
        from torch.distributed import nn as distributed_nn

        return distributed_nn.all_reduce(tensor, group=group)
    tensor = tensor.clone()
    dist.all_reduce(tensor, group=group)
    return tensor


def _placed(piece: torch.Tensor, rows: torch.Tensor, response: int) -> torch.Tensor:
    """[R, ...] zeros with `piece` at `rows` (differentiable in `piece`)."""
    full = piece.new_zeros((response, *piece.shape[1:]))
    return full.index_put((rows.to(piece.device),), piece)


def zigzag_from_local(pieces: list[torch.Tensor], local_len: int, total_lengths: list[int],
                      response_lengths: list[int], differentiable: bool = False) -> list[torch.Tensor]:
    """Per sample, the zigzag rows of per-token values a pass gave on this rank's contiguous rows
    (`pieces`: per sample, [rows held, ...]); `differentiable`: gradients flow back to every rank's
    piece (slime's redistribution of log-probs does the same)."""
    spans = local_spans(local_len, total_lengths, response_lengths)
    full = [_placed(piece, torch.arange(start, end), response)
            for piece, (start, end), response in zip(pieces, spans, response_lengths)]
    summed = _cp_sum(torch.cat(full), differentiable).split(list(response_lengths))
    return [values[zigzag_rows(total, response).to(values.device)]
            for values, total, response in zip(summed, total_lengths, response_lengths)]


def local_from_zigzag(per_sample: list[torch.Tensor], local_len: int, total_lengths: list[int],
                      response_lengths: list[int]) -> list[torch.Tensor]:
    """Per sample, the rows of this rank's contiguous slice from per-sample zigzag values (the
    rollout data's ids and masks)."""
    full = [_placed(values, zigzag_rows(total, response), response)
            for values, total, response in zip(per_sample, total_lengths, response_lengths)]
    summed = _cp_sum(torch.cat(full), differentiable=False).split(list(response_lengths))
    spans = local_spans(local_len, total_lengths, response_lengths)
    return [values[start:end] for values, (start, end) in zip(summed, spans)]


def whole_from_zigzag(per_sample: list[torch.Tensor], total_lengths: list[int],
                      response_lengths: list[int]) -> list[torch.Tensor]:
    """Per sample, the whole response's values from each context-parallel rank's zigzag rows (every
    rank gets them all; unchanged with one context-parallel rank)."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() == 1:
        return list(per_sample)
    full = [_placed(values, zigzag_rows(total, response), response)
            for values, total, response in zip(per_sample, total_lengths, response_lengths)]
    return list(_cp_sum(torch.cat(full), differentiable=False).split(list(response_lengths)))
