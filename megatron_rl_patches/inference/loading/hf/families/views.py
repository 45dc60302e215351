"""The slices fuse kinds fill a rank's parameter with, as views of the Hugging Face tensors (no
fused or sharded copy is made before the one into the parameter): a value for the whole target,
parts stacked along the rows, the rows a reordering picks read span by span."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron_rl_patches.inference.loading.hf.families.fuse_kind import Piece, Pieces


def whole(value: torch.Tensor) -> Pieces:
    """`value` is the whole target."""
    return tuple(value.shape), [(lambda target: target, value)]


def rows(start: int, stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda target: target[start:stop]


def stacked(parts: Sequence[torch.Tensor]) -> Pieces:
    """`parts` one after another along the rows."""
    pieces: list[Piece] = []
    start = 0
    for part in parts:
        pieces.append((rows(start, start + part.shape[0]), part))
        start += part.shape[0]
    return (start, *parts[0].shape[1:]), pieces


def row_numbers(t: torch.Tensor) -> torch.Tensor:
    return torch.arange(t.shape[0]).unsqueeze(-1)  # a column the row reorders move like the rows of `t`


def rows_in_order(t: torch.Tensor, order: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's rows of `t` reordered by `order` (the reordered row numbers), reading only the
    span of rows of `t` they lie in, not the whole tensor."""
    mine = order.reshape(-1).chunk(size)[rank]
    low, high = int(mine.min()), int(mine.max()) + 1
    return t[low:high].index_select(0, mine - low)


def fused_rows(rows_of: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`rows_of(*tensors)` for a `rows_of` that only picks and orders whole rows of its inputs,
    reading only the rows it picks: it is run on row labels first ((row, input) in one integer), then
    each run of consecutive rows of one input is sliced from it (a view) and the runs concatenated."""
    n = len(tensors)
    labels = rows_of(*[(torch.arange(t.shape[0]) * n + i).unsqueeze(-1) for i, t in enumerate(tensors)]).reshape(-1)
    which, row = labels % n, labels // n
    breaks = ((which[1:] != which[:-1]) | (row[1:] != row[:-1] + 1)).nonzero().reshape(-1) + 1
    starts = [0, *breaks.tolist()]
    stops = [*breaks.tolist(), labels.numel()]
    return torch.cat([tensors[int(which[a])][int(row[a]):int(row[a]) + b - a] for a, b in zip(starts, stops)])
