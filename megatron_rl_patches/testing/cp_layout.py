"""Helpers to split a test batch into a context-parallel rank's rows and to gather rows back in
sequence order, on the row layouts of `megatron_rl_patches.ops.context_rows` ("zigzag":
megatron-core's and Transformer Engine's; "contiguous": slime's `--allgather-cp`)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.ops.context_rows import LAYOUTS, check_layout, local_rows, sequence_rows

__all__ = ["LAYOUTS", "check_layout", "gather_rows", "local_rows", "sequence_rows", "split_batch", "split_rows"]


def split_rows(tensor: torch.Tensor, dim: int, layout: str, rank: int, cp_size: int,
               cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of `tensor` along `dim` (the sequence, or the packed stream) that `rank` holds."""
    length = None if cu_seqlens is not None else tensor.size(dim)
    rows = local_rows(layout, rank, cp_size, length=length, cu_seqlens=cu_seqlens)
    if cu_seqlens is not None and int(cu_seqlens[-1]) != tensor.size(dim):
        raise ValueError(
            f"cu_seqlens cover {int(cu_seqlens[-1])} rows, the tensor has {tensor.size(dim)} along dim {dim}")
    return tensor.index_select(dim, rows.to(tensor.device))


def split_batch(batch: Mapping[str, Any], layout: str, rank: int, cp_size: int,
                cu_seqlens: torch.Tensor | None = None) -> dict[str, Any]:
    """A batch of [b, s, ...] tensors (tokens, labels, position_ids, masks, ...; packed: b = 1)
    cut to `rank`'s rows along dim 1. "attention_mask" becomes None: the context-parallel
    attention masks causally by each row's global position. Other values pass through."""
    tokens = batch.get("tokens")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError("batch['tokens'] must be a [b, s] tensor (the sequence, or the packed stream, on dim 1)")
    seq = tokens.size(1)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key == "attention_mask":
            out[key] = None
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == seq:
            out[key] = split_rows(value, 1, layout, rank, cp_size, cu_seqlens)
        else:
            out[key] = value
    return out


def gather_rows(local: torch.Tensor, dim: int, layout: str, group: Any = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's rows of `local` along `dim`, gathered over the context-parallel `group`
    (default: megatron's) and put back in sequence order (no gradient)."""
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    cp_size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    total = local.size(dim) * cp_size
    length = None if cu_seqlens is not None else total
    shape = list(local.shape)
    shape[dim] = total
    out = local.new_empty(shape)
    for rank, part in enumerate(parts):
        rows = local_rows(layout, rank, cp_size, length=length, cu_seqlens=cu_seqlens)
        out.index_copy_(dim, rows.to(out.device), part)
    return out
