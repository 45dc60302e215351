"""The one top-k id selection of `topk_ids` and `lm_head_topk_ids`: the k largest logits per row,
value descending, ties to the lower id, exact in every dtype (fp64 included), from any source of
logits tiles (row chunks of materialized logits, or h·Wᵀ tiles of the fused head).

Each tile gives its k+1 best values; its k best join the row's running candidates, merged by
(value desc, id asc). A wide tile is first cut to the blocks that can hold its k best (one max
pass over blocks of BLOCK columns; the k best blocks by their max hold every value above the
(k+1)-th block max), so ``torch.topk`` ranks k·BLOCK candidates instead of the whole tile.
``torch.topk`` picks arbitrarily among values equal to a tile's cut, so a tile whose k-th value
equals its (k+1)-th, or the largest block max left out, records that value as ambiguous. A row
is exact unless its final cut equals such a value (rare: equal logits at the k-th place); those
rows are re-ranked exactly, column by column (:func:`exact_rows`). Ranks all-gather their k
candidates and merge them alike (O(T·k·tp)), so every rank returns the same ids. Bad rows (NaN,
+inf, or no finite logit) and the ambiguous rows come back with the call's one host sync.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl_patches.ops import _dist

Tiles = Iterator[tuple[slice, slice, torch.Tensor]]  # (rows, local columns, x) as kernels.torch_tiles.tiles


@dataclass
class RunningTopk:
    """A row's k best (value, global id) so far, descending; `ambiguous`: the largest value at
    which a tile's cut was tied (-inf: none); `row_max`: the largest logit (NaN as +inf)."""

    values: torch.Tensor  # [T, k]
    ids: torch.Tensor  # [T, k] int64; `sentinel` where fewer than k columns were seen
    ambiguous: torch.Tensor  # [T]
    row_max: torch.Tensor  # [T]
    sentinel: int  # an id past the vocabulary: sorts after every real id of equal value

    @classmethod
    def empty(cls, n_rows: int, k: int, dtype: torch.dtype, device: torch.device, sentinel: int) -> RunningTopk:
        def full(shape: tuple[int, ...], value: float) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        return cls(full((n_rows, k), -math.inf), torch.full((n_rows, k), sentinel, dtype=torch.long, device=device),
                   full((n_rows,), -math.inf), full((n_rows,), -math.inf), sentinel)


def best_of(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best (value descending, then id ascending) of each row's candidates."""
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    best = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]
    return values.gather(-1, best), ids.gather(-1, best)


BLOCK = 32  # columns per block of the prefilter: its max pass runs at memory speed on CPU
BLOCKS_PER_SLOT = 4  # a tile is prefiltered when it holds at least this many blocks per slot (k+1)


def fold_tile(run: RunningTopk, rows: slice, x: torch.Tensor, first_id: int) -> None:
    """One tile x [r, c] whose first column is global id `first_id` into the running top-k."""
    k = run.values.size(1)
    n_blocks = x.size(1) // BLOCK
    if n_blocks >= BLOCKS_PER_SLOT * (k + 1) and x.size(0):
        body = n_blocks * BLOCK
        if body < x.size(1):  # the last, partial block: a tile of its own
            fold_tile(run, rows, x[:, body:], first_id + body)
        top, at, outside = _block_candidates(x[:, :body], k, n_blocks)
    else:
        top, at = torch.topk(x, min(k + 1, x.size(1)), dim=1)
        outside = None
    if top.size(1) > k:
        cut = top[:, k - 1]
        tie = cut == top[:, k]
        if outside is not None:  # a value outside the candidate blocks can equal the cut, never pass it
            tie |= cut <= outside
        tied = torch.where(tie, cut, -math.inf).to(run.ambiguous.dtype)
        run.ambiguous[rows] = torch.maximum(run.ambiguous[rows], tied)
        top, at = top[:, :k], at[:, :k]
    run.values[rows], run.ids[rows] = best_of(torch.cat([run.values[rows], top.to(run.values.dtype)], dim=1),
                                              torch.cat([run.ids[rows], at + first_id], dim=1), k)
    # the tile's max is its first value (torch.topk ranks NaN first): no pass of its own
    first = top[:, 0].to(run.row_max.dtype)
    run.row_max[rows] = torch.maximum(run.row_max[rows], torch.where(torch.isnan(first), math.inf, first))


def _block_candidates(x: torch.Tensor, k: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k+1 best values of x [r, n_blocks·BLOCK] among its k best blocks by block max, their
    columns, and the largest block max left out [r]. Every value of x above that max is in the
    k best blocks (each of them holds a value at least as large), so the k best values are
    exact unless the cut equals it (the caller marks those rows ambiguous). NaN: torch.topk ranks
    a NaN block max first, so a NaN still reaches the row max."""
    blocks = x.unflatten(1, (n_blocks, BLOCK))
    block_top, block_at = torch.topk(blocks.amax(dim=2), k + 1, dim=1)
    chosen = block_at[:, :k]
    candidates = blocks.gather(1, chosen[:, :, None].expand(-1, -1, BLOCK)).flatten(1)
    top, at = torch.topk(candidates, k + 1, dim=1)
    at = chosen.gather(1, at // BLOCK) * BLOCK + at % BLOCK
    return top, at, block_top[:, k]


def fold_tiles(run: RunningTopk, tiles: Tiles, first_id: int) -> RunningTopk:
    """Every tile (rows, local columns, x) of a source folded into `run`: the torch tiles' top-k
    step (a backend's ``topk``)."""
    for rows, cols, x in tiles:
        if x.size(1):
            fold_tile(run, rows, x, first_id + cols.start)
    return run


def over_ranks(run: RunningTopk, group: dist.ProcessGroup | None) -> RunningTopk:
    """Every rank's candidates merged (all-gather of k values and ids per row over the
    tensor-parallel group, O(T·k·tp)) and the ambiguity and row max combined (one MAX
    all-reduce): the same on every rank."""
    if _dist.tp_size(group) == 1:
        return run
    k = run.values.size(1)
    values, ids = best_of(_dist.all_gather_last_dim(run.values, group), _dist.all_gather_last_dim(run.ids, group), k)
    maxima = _dist.all_reduce_max_(torch.stack([run.ambiguous, run.row_max]), group)
    return RunningTopk(values, ids, maxima[0], maxima[1], run.sentinel)


def ambiguous_rows(run: RunningTopk) -> torch.Tensor:
    """[T] bool: rows whose final cut equals a value some tile's ``torch.topk`` cut arbitrarily
    (no tile can hold k values above the final cut, so only equality matters)."""
    return run.ambiguous >= run.values[:, -1]


def exact_rows(run: RunningTopk, rows: list[int], row_tiles: Callable[[list[int], torch.Tensor], Tiles],
               first_id: int,
               group: dist.ProcessGroup | None) -> None:
    """Re-rank `rows` (ambiguous, the same on every rank) exactly, in place: the values above the
    final cut stay; the slots at the cut go to the lowest ids holding it, found on every rank
    by a running count of the columns equal to the cut (`row_tiles(rows, index)` walks those
    rows' logits tiles in column order, as (positions in `rows`, columns, x)), then merged over
    the ranks. Rows whose cut is -inf are re-ranked too (a tie at -inf is not told apart)."""
    index = torch.tensor(rows, dtype=torch.long, device=run.values.device)
    k = run.values.size(1)
    cut = run.values[index, -1:]
    above = run.values[index] > cut  # a prefix of each row
    need = k - above.sum(dim=1, keepdim=True)  # slots at the cut, >= 1
    lowest = torch.full((index.numel(), k), torch.iinfo(torch.long).max, dtype=torch.long, device=index.device)
    seen = torch.zeros_like(need)
    for sub, cols, x in row_tiles(rows, index):
        equal = x == cut[sub]
        rank = torch.cumsum(equal, dim=1, dtype=torch.long) + seen[sub]  # 1, 2, ... over the cut's columns
        take = equal & (rank <= need[sub])
        col_ids = torch.arange(cols.start, cols.start + x.size(1), device=x.device) + first_id
        found = torch.where(take, col_ids, torch.iinfo(torch.long).max)
        lowest[sub] = torch.topk(torch.cat([lowest[sub], found], dim=1), k, dim=1, largest=False).values
        seen[sub] += equal.sum(dim=1, keepdim=True)
    if _dist.tp_size(group) > 1:  # the lowest ids over every rank's columns (all-gather, O(rows·k·tp))
        lowest = torch.topk(_dist.all_gather_last_dim(lowest, group), k, dim=1, largest=False).values
    slot = torch.arange(k, device=index.device)[None, :]
    at_cut = lowest.gather(1, (slot - (k - need)).clamp(0, k - 1))
    run.ids[index] = torch.where(above, run.ids[index], at_cut)
