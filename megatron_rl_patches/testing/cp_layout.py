"""Which rows of a sequence each context-parallel rank holds, in the two layouts jobs run, and
helpers to split a batch into a rank's rows and to gather rows back in sequence order.

- "zigzag": each sequence is cut into 2·cp equal chunks; rank r holds chunks r and 2·cp−1−r
  (megatron-core's and Transformer Engine's layout, which balances causal attention work).
- "contiguous": rank r holds the r-th of cp equal slices of the (packed) stream (slime's
  `--allgather-cp`).

For packed `thd` input (`cu_seqlens`, the global, padded boundaries of the sequences in the
stream), "zigzag" cuts every sequence on its own (each length a multiple of 2·cp), "contiguous"
cuts the whole stream (its length a multiple of cp).
"""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} (context-parallel row layout), got {layout!r}")
    return str(layout)


def _check_rank(rank: int, cp_size: int) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < cp_size:
        raise ValueError(f"rank must be an int in [0, cp_size={cp_size}), got {rank!r}")


def _divisible(length: int, parts: int, what: str) -> int:
    if length % parts:
        raise ValueError(f"{what} has length {length}, not a multiple of {parts}: pad it to a multiple of {parts}")
    return length // parts


def sequence_rows(layout: str, rank: int, cp_size: int, length: int) -> torch.Tensor:
    """Indices (into one sequence of `length` rows) of the rows `rank` holds, in its local order."""
    check_layout(layout)
    _check_rank(rank, cp_size)
    if layout == "contiguous":
        size = _divisible(length, cp_size, "the sequence")
        return torch.arange(rank * size, (rank + 1) * size)
    chunk = _divisible(length, 2 * cp_size, "the sequence (zigzag cuts it into 2*cp chunks)")
    mirror = 2 * cp_size - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange(mirror * chunk, (mirror + 1) * chunk)])


def _cu_seqlens(cu_seqlens: Any) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor [n_sequences + 1] of cumulative (padded) lengths from 0")
    cu = cu_seqlens.to(device="cpu", dtype=torch.long)
    if int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {cu.tolist()}")
    return cu


def local_rows(layout: str, rank: int, cp_size: int, *, length: int | None = None,
               cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Global indices of the rows `rank` holds: of one sequence of `length` rows (`bshd`), or of
    the packed stream described by the global `cu_seqlens` (`thd`)."""
    if (length is None) == (cu_seqlens is None):
        raise ValueError("give exactly one of length= (bshd) or cu_seqlens= (packed thd)")
    if cu_seqlens is None:
        assert length is not None
        return sequence_rows(layout, rank, cp_size, length)
    cu = _cu_seqlens(cu_seqlens)
    if check_layout(layout) == "contiguous":
        return sequence_rows(layout, rank, cp_size, int(cu[-1]))
    return torch.cat([int(start) + sequence_rows(layout, rank, cp_size, int(end - start))
                      for start, end in zip(cu[:-1], cu[1:])])


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
