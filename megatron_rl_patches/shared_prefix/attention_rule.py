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


def sees(row: Any, column: Any, reach: torch.Tensor, positions: torch.Tensor | None = None,
         window: int | None = None) -> Any:
    """Whether physical row `row` attends physical row `column` (tensors of indices, broadcast);
    `window`: a sliding window of that many earlier positions besides the row's own, measured in each
    token's own `positions` (megatron-core's `window_size[0]`)."""
    seen = (column <= row) & (row < reach[column])
    if window is not None and positions is not None:
        seen = seen & (positions[row] - positions[column] <= window)
    return seen


@dataclass(frozen=True, eq=False)
class Block:
    """Query rows [rows[0], rows[1]) against key rows [keys[0], keys[1]): a segment against its own
    keys (`own`: causally) or the rows below it against them (wholly), or under `mask` ([rows, keys]
    bool) where a window cuts the block."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    own: bool
    mask: torch.Tensor | None = None

    @property
    def causal(self) -> bool:
        return self.own and self.mask is None


def pieces(segment_starts: torch.Tensor, segment_ends: torch.Tensor, segment_reach: torch.Tensor,
           positions: torch.Tensor | None = None, window: int | None = None) -> tuple[Block, ...]:
    """The rule in blocks for segments [starts, ends) whose subtrees end at `segment_reach`: every
    segment against its own keys first (causally), then the rows of its subtree below it against
    them (wholly); under a `window`, a block's mask is `sees` read on the block (left out where it
    sees nothing, kept plain where it sees everything)."""
    bounds = list(zip(segment_starts.tolist(), segment_ends.tolist(), segment_reach.tolist()))
    own = [Block((start, end), (start, end), True) for start, end, _ in bounds if end > start]
    below = [Block((end, reach), (start, end), False) for start, end, reach in bounds if reach > end > start]
    if window is None or positions is None:
        return (*own, *below)
    reach = torch.repeat_interleave(segment_reach, segment_ends - segment_starts)
    cut = []
    for block in (*own, *below):
        rows, keys = torch.arange(*block.rows), torch.arange(*block.keys)
        mask = sees(rows[:, None], keys[None, :], reach, positions, window)
        plain = (torch.ones_like(mask).tril() if block.own else torch.ones_like(mask)) == mask
        if block.own or mask.any():
            cut.append(block if bool(plain.all()) else Block(block.rows, block.keys, block.own, mask))
    return tuple(cut)


def dense(length: int, reach: torch.Tensor, start: int = 0, end: int | None = None,
          positions: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """[rows, rows] bool: the rule over the rows [start, end) (a reference, and the fallback route's mask)."""
    index = torch.arange(start, length if end is None else end, device=reach.device)
    return sees(index[:, None], index[None, :], reach, positions, window)
