"""Tensor-parallel plumbing shared by the vocab-parallel ops. `group=None` means no tensor
parallelism (never "the world": under data parallelism that would be silently wrong)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def tp_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def vocab_start(local_vocab: int, group: dist.ProcessGroup | None) -> int:
    """Global id of this rank's first vocab column (Megatron shards the vocab evenly)."""
    return tp_rank(group) * local_vocab


def all_reduce_max_(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place MAX over the group (no autograd); identity without tensor parallelism."""
    if group is not None and tp_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_reduce_sum_(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place SUM over the group (no autograd); identity without tensor parallelism."""
    if group is not None and tp_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate each rank's tensor along the last dim, in rank order (no autograd)."""
    if group is None or tp_size(group) == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(tp_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
