"""Which rows of a sequence each context-parallel rank holds, in the two layouts jobs run:

- "zigzag": each sequence is cut into 2·cp equal chunks; rank r holds chunks r and 2·cp−1−r
  (megatron-core's and Transformer Engine's layout, which balances causal attention work).
- "contiguous": rank r holds the r-th of cp equal slices of the (packed) stream (slime's
  `--allgather-cp`).

For packed `thd` input (`cu_seqlens`, the global, padded boundaries of the sequences in the
stream), "zigzag" cuts every sequence on its own (each length a multiple of 2·cp), "contiguous"
cuts the whole stream (its length a multiple of cp). Pure index arithmetic on torch tensors: the
layers that exchange rows over a context-parallel group (the gated delta net's recurrence, the
test kit's attention) and the test kit's batch splitting read the same rule."""
from __future__ import annotations

from typing import Any

import torch

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


