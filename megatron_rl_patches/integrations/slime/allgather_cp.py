"""slime's `--allgather-cp` (624b824a) for top-k OPD: each context-parallel rank runs the model on
a contiguous slice of the packed stream, while slime keeps every per-sample field of its rollout
data (log-probs, advantages, masks) in the zigzag rows of the rank (its
`_allgather_cp_redistribute`). Top-k OPD's [R, k] ids and buckets follow the same rule: a pass's
contiguous rows go to the zigzag rows for the rollout data (`zigzag_from_local`), and the rollout's
ids go back to the contiguous rows of a pass (`local_from_zigzag`). Both are the ops' row moves
(`ops.packing`: one sum over the context-parallel group, as slime's own redistribution); slime's
zigzag (`cp_utils`) is the ops' `thd` zigzag, whose whole-response moves every Megatron host shares
(`integrations.megatron.opd.zigzag`)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.ops.packing import PackedLayout, allgather_cp_to_zigzag, zigzag_to_allgather_cp


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
