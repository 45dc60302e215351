"""Top-k buckets on slime's fused route: per-token results cut back to slime's per-sample response
slices (`sample_rows`: in the rows slime keeps per-sample fields in); the processor's context is
`integrations.megatron.opd.fused_context.topk_context`'s, at slime's response rows."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd.zigzag import zigzag_from_local
from megatron_rl_patches.integrations.slime.rows import response_positions


def per_sample_rows(values: torch.Tensor, batch: dict, allgather_cp: bool = False) -> list[torch.Tensor]:
    """[1, T, ...] per-token values of a micro-batch as slime's per-sample response slices."""
    rows = values.reshape(-1, *values.shape[2:])
    return [rows[p] for p in response_positions(batch, rows.shape[0], rows.device, allgather_cp)]


def allgather_cp_active(args: Any) -> bool:
    """Whether slime's `--allgather-cp` is on with more than one context-parallel rank: each rank runs
    the model on a contiguous slice of the packed stream, while slime keeps every per-sample field in
    the rank's zigzag rows (its `_allgather_cp_redistribute`), top-k OPD's too (`sample_rows`)."""
    if not getattr(args, "allgather_cp", False):
        return False
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size() > 1


def sample_rows(values: torch.Tensor, batch: dict, allgather: bool) -> list[torch.Tensor]:
    """[1, T, ...] per-token values in the rows slime keeps per-sample fields in: its response
    slices, moved to the rank's zigzag rows under an active `--allgather-cp` (`allgather`; gradients
    flow back when the values require grad, as in slime's own redistribution)."""
    pieces = per_sample_rows(values, batch, allgather)
    if not allgather:
        return pieces
    return zigzag_from_local(pieces, values.shape[1], batch["total_lengths"], batch["response_lengths"])
