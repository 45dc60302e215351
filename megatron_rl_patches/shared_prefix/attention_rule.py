"""The one attention rule of a shared-prefix stream: a row sees its ancestors and itself, causally.

The plan lays the samples' trie out in preorder (`tree`), so the rows under a segment are one
contiguous range, ending at `reach`: row r attends column c exactly when

    c <= r < reach[c]

(c at or before r, and r inside the subtree of c's segment: c's segment is r's or an ancestor of
it). Every route is made from `sees`: FlexAttention's block mask calls it as its mask function; the
CPU route's blocks (`pieces`) are the same rule read a segment of columns at a time: the columns
[start, end) of a segment are seen by its own rows causally (the diagonal piece) and by every row of
its subtree below it, [end, reach), wholly (the piece below); no other row sees them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def sees(row: Any, column: Any, reach: torch.Tensor) -> Any:
    """Whether physical row `row` attends physical row `column` (tensors of indices, broadcast)."""
    return (column <= row) & (row < reach[column])


@dataclass(frozen=True)
class Pieces:
    """The rule in blocks of rows: `own` [(start, end)]: each segment's rows against its own keys,
    causally; `below` [(start, end, reach)]: the rows [end, reach) of a segment's subtree below it
    against the segment's keys [start, end), wholly."""

    own: tuple[tuple[int, int], ...]
    below: tuple[tuple[int, int, int], ...]


def pieces(segment_starts: torch.Tensor, segment_ends: torch.Tensor, segment_reach: torch.Tensor) -> Pieces:
    """The rule's blocks for segments [starts, ends) whose subtrees end at `segment_reach`."""
    own, below = [], []
    for start, end, reach in zip(segment_starts.tolist(), segment_ends.tolist(), segment_reach.tolist()):
        if end > start:
            own.append((start, end))
            if reach > end:
                below.append((start, end, reach))
    return Pieces(tuple(own), tuple(below))


def dense(length: int, reach: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
    """[rows, rows] bool: the rule over the rows [start, end) (a reference, and the fallback route's mask)."""
    index = torch.arange(start, length if end is None else end, device=reach.device)
    return sees(index[:, None], index[None, :], reach)
