"""The samples' trie, found by value and laid out once: every leading-token sequence two samples
share, at any depth, is one run of physical rows.

The samples are sorted (as big-endian bytes: C comparisons, a prefix before its extensions) and
each one's longest common prefix with its predecessor is found at once over the whole batch (torch
ops). In that order the trie is the LCP-interval tree, built with a stack in one pass over the
samples (near-linear): each branch point is a node at the depth where two neighbours first differ,
each sample a leaf at its own length (a sample equal to another, or another's prefix, is a leaf of
no tokens of its own under the node where it ends).

`min_shared` per branch: a node shared by two or more samples is laid out as its own segment when
it adds at least `min_shared` tokens to the segment above it; otherwise its tokens are not shared
and go down into each of its children (a child's segment then starts where the segment above it
ended). A sample's own remainder is laid out whatever its length. With `min_shared` 1 the physical
rows are the trie's nodes, each computed once.

The layout is the tree's preorder (a segment, then its children's subtrees in the order of their
first sample), so a segment's subtree is one contiguous range of rows: a row attends a column
exactly when `column <= row < reach[column]` (`reach`: the end of the column's subtree), the
whole rule of `attention_rule`."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeLayout:
    """Segments in physical order (int64 tensors [n_segments]): first row `starts`, `lengths`,
    `parents` (-1 under the root), `depths` (0 under the root), `positions` (of the first token in
    its samples), `sources` (the logical index of the first token in one sample holding it), `reach`
    (the end of its subtree's rows); `tops`: per subtree under the root, its samples and the tokens
    its top segment holds when it holds two or more samples (0 otherwise); `logical_rows` [tokens]:
    the physical row of each sample token."""

    starts: torch.Tensor
    lengths: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    positions: torch.Tensor
    sources: torch.Tensor
    reach: torch.Tensor
    tops: tuple[tuple[tuple[int, ...], int], ...]
    logical_rows: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.lengths.sum())


def per_run(values: torch.Tensor, starts: torch.Tensor, total: int) -> torch.Tensor:
    """[total]: `values[k]` at each element of run k, where the runs tile [0, total) in order and
    run k starts at `starts[k]` (an empty run starts where the next does): the changes scattered at
    the starts, summed (O(total), no thread pool and no search)."""
    change = values.clone()
    change[1:] -= values[:-1]
    out = torch.zeros(total + 1, dtype=values.dtype)
    out.index_add_(0, starts, change)
    return out[:total].cumsum(0)


def run_of(counts: torch.Tensor) -> torch.Tensor:
    """[counts.sum()]: the index of the run each element lies in, runs of `counts` elements."""
    return per_run(torch.arange(counts.numel()), counts.cumsum(0) - counts, int(counts.sum()))


def sorted_samples(ids: torch.Tensor, starts: list[int], ends: list[int]) -> list[int]:
    """The samples' indices in lexicographic order of their tokens (ties: by index)."""
    if not starts:
        return []
    stream = ids[:ends[-1]]
    values = (stream - stream.min()).numpy()
    width = 8 if values.max() >= 2 ** 32 else 4
    data = values.astype(f">u{width}").tobytes()  # big-endian: bytes compare as the ids do
    keys = [data[width * start:width * end] for start, end in zip(starts, ends)]
    return sorted(range(len(keys)), key=keys.__getitem__)


def adjacent_common(ids: torch.Tensor, starts: list[int], lengths: list[int]) -> list[int]:
    """How many leading tokens sample i shares with sample i + 1 (samples given by their `starts`
    and `lengths` in the stream `ids`, in the order to compare): one vectorized comparison a pair."""
    values = ids.numpy()
    common = []
    for i in range(len(starts) - 1):
        a, b, span = starts[i], starts[i + 1], min(lengths[i], lengths[i + 1])  # samples are never empty
        differ = values[a:a + span] != values[b:b + span]
        first = int(differ.argmax())
        common.append(first if differ[first] else span)
    return common


def lcp_tree(order: list[int], lengths: list[int], common: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(parent, depth, sample) per node of the samples' compressed trie; node 0 the root (depth 0),
    sample -1 for a branch point; a sample's leaf has no children."""
    parent, depth, sample = [-1], [0], [-1]
    stack = [0]
    for i in range(len(order) + 1):
        shared = common[i - 1] if 0 < i < len(order) else 0
        while sample[stack[-1]] >= 0 or depth[stack[-1]] > shared:
            node = stack.pop()
            below = stack[-1]
            if depth[below] < shared:  # the branch point is new: between `below` and `node`
                parent.append(below)
                depth.append(shared)
                sample.append(-1)
                stack.append(len(depth) - 1)
                parent[node] = stack[-1]
                break
            parent[node] = below
        if i < len(order):
            parent.append(-1)
            depth.append(lengths[order[i]])
            sample.append(order[i])
            stack.append(len(depth) - 1)
    return parent, depth, sample


def tree_layout(ids: torch.Tensor, starts: list[int], ends: list[int], min_shared: int,
                levels: int | None = None) -> TreeLayout:
    """The layout of the samples [starts[i], ends[i]) of the packed `ids` (see the module), at most
    `levels` shared segments on a sample's path (None: every level; 1: a group's longest common
    prefix, then each member's rest whole)."""
    n = len(starts)
    lengths = [end - start for start, end in zip(starts, ends)]
    order = sorted_samples(ids, starts, ends)
    common = adjacent_common(ids, [starts[i] for i in order], [lengths[i] for i in order])
    parent, depth, sample = lcp_tree(order, lengths, common)
    nodes = len(depth)
    children: list[list[int]] = [[] for _ in range(nodes)]
    for node in range(1, nodes):
        children[parent[node]].append(node)
    # top-down (a node's parent before it): nodes by depth, a branch point before a leaf of its depth
    topdown = sorted(range(nodes), key=lambda x: (depth[x], sample[x] >= 0))
    first = [n] * nodes  # each node's first sample (by index)
    for node in reversed(topdown):
        if sample[node] >= 0:
            first[node] = sample[node]
        if node:
            first[parent[node]] = min(first[parent[node]], first[node])
    laid_under = [0] * nodes  # the nearest laid-out node above (or the node itself once laid)
    laid = [False] * nodes
    laid[0] = True
    kids: list[list[int]] = [[] for _ in range(nodes)]
    ending: list[list[int]] = [[] for _ in range(nodes)]  # samples ending inside a laid-out node's rows
    level = [0] * nodes  # shared segments laid out on the path down to a node
    for node in topdown[1:]:
        above = laid_under[parent[node]]
        gain = depth[node] - depth[above]
        shares = gain >= min_shared and (levels is None or level[above] < levels)
        laid[node] = gain > 0 and (sample[node] >= 0 or shares)
        laid_under[node] = node if laid[node] else above
        level[node] = level[above] + (1 if laid[node] and sample[node] < 0 else 0)
        if laid[node]:
            kids[above].append(node)
        if sample[node] >= 0:
            ending[laid_under[node]].append(sample[node])
    for kid in kids:  # preorder over the laid-out nodes, children by their first sample
        kid.sort(key=first.__getitem__)
    preorder: list[int] = []
    seg_parent: list[int] = []
    seg_depth: list[int] = []
    seg_base: list[int] = []
    held: list[int] = []  # the samples, each at the segment where it ends, in preorder
    low: list[int] = []  # the samples under segment s: held[low[s]:high[s]]
    high: list[int] = []
    walk = [(node, -1, 0) for node in reversed(kids[0])]
    while walk:
        node, up, tier = walk.pop()
        segment = len(preorder)
        preorder.append(node)
        seg_parent.append(up)
        seg_depth.append(tier)
        seg_base.append(depth[laid_under[parent[node]]])
        low.append(len(held))
        held.extend(sorted(ending[node]))
        high.append(len(held))
        walk.extend((kid, segment, tier + 1) for kid in reversed(kids[node]))
    count = len(preorder)
    seg_len = [depth[node] - base for node, base in zip(preorder, seg_base)]
    subtree = list(seg_len)  # children after their parent in preorder: summed from the end
    for segment in range(count - 1, -1, -1):
        up = seg_parent[segment]
        if up >= 0:
            subtree[up] += subtree[segment]
            high[up] = max(high[up], high[segment])
    tops = tuple((tuple(sorted(held[low[s]:high[s]])), seg_len[s] if high[s] - low[s] > 1 else 0)
                 for s in range(count) if seg_parent[s] < 0)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    positions, seg_lengths = tensor(seg_base), tensor(seg_len)
    seg_starts = seg_lengths.cumsum(0) - seg_lengths
    sample_start = tensor(starts)
    sources = sample_start[tensor([first[node] for node in preorder])] + positions
    logical_rows = _logical_rows(tensor(low), tensor(high), tensor(held), sample_start, seg_starts, seg_lengths,
                                 positions, ends[-1] if ends else 0)
    return TreeLayout(starts=seg_starts, lengths=seg_lengths, parents=tensor(seg_parent), depths=tensor(seg_depth),
                      positions=positions, sources=sources, reach=seg_starts + tensor(subtree), tops=tops,
                      logical_rows=logical_rows)


def _logical_rows(low: torch.Tensor, high: torch.Tensor, held: torch.Tensor, sample_start: torch.Tensor,
                  seg_starts: torch.Tensor, seg_lengths: torch.Tensor, positions: torch.Tensor,
                  tokens: int) -> torch.Tensor:
    """[tokens]: each sample token's physical row: every segment's rows serve each sample under it,
    at the sample's own offsets; those runs tile the samples' tokens, so the map is one shift per run."""
    if not seg_starts.numel():
        return torch.empty(tokens, dtype=torch.int64)
    counts = high - low
    pair_segment = run_of(counts)
    offset = torch.arange(pair_segment.numel()) - (counts.cumsum(0) - counts)[pair_segment]
    logical = sample_start[held[low[pair_segment] + offset]] + positions[pair_segment]
    logical, order = logical.sort()
    shift = seg_starts[pair_segment[order]] - logical
    return torch.arange(tokens) + per_run(shift, logical, tokens)
