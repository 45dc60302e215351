"""Micro-batches counted in physical tokens: a group's prefix once, then each member's own tokens.

A hand-written loop cuts its samples into micro-batches of at most `max_tokens` tokens as the model
will compute them under shared-prefix plans. Per micro-batch (`plan_shared_prefix` for each): a
group stays whole in one micro-batch unless it alone exceeds the budget; then it is cut into parts,
each carrying the prefix again. Groups are placed first-fit, largest first (fewer micro-batches than
placing them in order), and every micro-batch keeps its samples in their original order.

Per step (`held_cost`, for `plan_shared_prefix_step`, which holds a segment its micro-batches share):
the samples are taken in the order of their trie (a group's members, a subtree's samples, next to one
another) and placed next-fit, so a group the budget cuts lies in consecutive micro-batches; each
segment counts once per step, in the micro-batch that first reads it, and every later reader counts
its held state, `held_cost` of a computed row per row (a held row's bytes over a computed row's:
keys and values beside a layer's activations); a sample longer than the budget counts its last
chunk whole and the chunks before it held (the step plan cuts it so).

The cost grows as n log n in the samples (the grouping's and the first fit's), whether they share one
prompt or none; the cyclic garbage collector is paused throughout, as in the grouping (see
grouping.py)."""
from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl_patches.shared_prefix.grouping import collector_paused, find_groups
from megatron_rl_patches.shared_prefix.tree import run_of, sorted_samples, tree_layout

NAME = "shared_prefix_micro_batches"
LARGEST_ID = 2 ** 63 - 1  # an int64 tensor's


def _refuse_id(values: Sequence[Any], index: int) -> None:
    """The first id of samples[index] that is not an int in [0, 2**63), refused by name."""
    for position, value in enumerate(values):
        try:
            number = operator.index(value)
        except TypeError:
            raise TypeError(f"{NAME}: samples[{index}][{position}] must be an int token id, got {value!r} "
                            f"({type(value).__name__}); pass the ids as ints") from None
        if not 0 <= number <= LARGEST_ID:
            raise ValueError(f"{NAME}: samples[{index}][{position}] is {number}, not a token id (0 to 2**63 - 1)")


def sample_ids(sample: Any, index: int) -> array:
    """samples[index]'s ids (a 1-D integer tensor or array, or a sequence of ints) as an array ('I' where
    they fit in 32 bits, else 'q'), refused by name where an id is no int (a float is never
    truncated, a string never parsed) or negative."""
    if isinstance(sample, torch.Tensor):
        if (sample.dim() != 1 or sample.dtype.is_floating_point or sample.dtype.is_complex
                or sample.dtype == torch.bool or sample.device.type == "meta"):
            raise ValueError(f"{NAME}: samples[{index}] must be a 1-D tensor of ids, got "
                             f"{tuple(sample.shape)} {sample.dtype} on {sample.device}")
        values: Any = sample.tolist()
    elif isinstance(sample, Sequence) and not isinstance(sample, (str, bytes)):
        values = sample
    elif getattr(sample, "ndim", None) == 1 and callable(getattr(sample, "tolist", None)):  # a NumPy array
        values = sample.tolist()
    else:
        raise TypeError(f"{NAME}: samples[{index}] must be a 1-D tensor or a list of ids, got "
                        f"{type(sample).__name__}")
    try:
        return array("I", values)  # a float, a string, None: TypeError, never converted
    except (TypeError, OverflowError):
        pass
    try:
        ids = array("q", values)
    except (TypeError, OverflowError):
        _refuse_id(values, index)
        raise
    raw = ids.tobytes()
    signs = raw[ids.itemsize - 1::ids.itemsize] if sys.byteorder == "little" else raw[::ids.itemsize]
    if not signs.isascii():  # a byte >= 128 holds a sign bit: a negative id
        _refuse_id(values, index)
    return ids


class _FirstFit:
    """Bins of one capacity filled first-fit: the first bin with room found in O(log bins) (a tree
    of the most room left per range of bins), not by a scan of every bin."""

    def __init__(self, capacity: int, most_bins: int) -> None:
        self.capacity = capacity
        self.leaves = 1
        while self.leaves < max(1, most_bins):
            self.leaves *= 2
        self.room = [-1] * (2 * self.leaves)  # bins not yet opened: no room (opened on demand)
        self.used: list[int] = []
        self.held: list[list[int]] = []

    def _set(self, bin_index: int, room: int) -> None:
        node = self.leaves + bin_index
        self.room[node] = room
        node //= 2
        while node:
            self.room[node] = max(self.room[2 * node], self.room[2 * node + 1])
            node //= 2

    def place(self, cost: int, members: list[int]) -> None:
        if self.room[1] >= cost:
            node = 1
            while node < self.leaves:  # the leftmost bin with room
                node = 2 * node if self.room[2 * node] >= cost else 2 * node + 1
            bin_index = node - self.leaves
            self.used[bin_index] += cost
            self.held[bin_index].extend(members)
        else:
            bin_index = len(self.used)
            self.used.append(cost)
            self.held.append(list(members))
        self._set(bin_index, self.capacity - self.used[bin_index])


def physical_micro_batches(values: Sequence[Sequence[int]], max_tokens: int, min_shared: int = 1) -> list[list[int]]:
    """The micro-batches of `values` (checked ids) at most `max_tokens` physical tokens each; a
    sample longer than `max_tokens` alone in its own (as slime's first fit places one)."""
    with collector_paused():  # no cycles made: see grouping.py
        parts: list[tuple[int, list[int]]] = []  # (physical tokens, members)
        for group in find_groups(values, min_shared):
            part: list[int] = []
            cost = 0
            for member in group.members:
                own = len(values[member]) - group.shared
                if part and cost + own > max_tokens:  # the group exceeds the budget: a new part, the prefix again
                    parts.append((cost, part))
                    part, cost = [], 0
                if not part:
                    cost = group.shared
                part.append(member)
                cost += own
            parts.append((cost, part))
        bins = _FirstFit(max_tokens, len(parts))
        for cost, members in sorted(parts, key=lambda p: (-p[0], p[1][0])):
            bins.place(cost, members)
        return sorted((sorted(held) for held in bins.held), key=lambda held: held[0])


def step_micro_batches(values: Sequence[Sequence[int]], max_tokens: int, min_shared: int = 1,
                       held_cost: float = 1.0) -> list[list[int]]:
    """The micro-batches of `values` (checked ids) placed once per step (see the module)."""
    with collector_paused():
        lengths = [len(v) for v in values]
        ids = torch.tensor([t for v in values for t in v], dtype=torch.int64)
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]] if values else []
        ends = [a + n for a, n in zip(starts, lengths)]
        tree = tree_layout(ids, starts, ends, min_shared)
        segment_of = run_of(tree.lengths).index_select(0, tree.logical_rows).tolist()
        paths = [sorted(set(segment_of[a:b])) for a, b in zip(starts, ends)]
        rows = tree.lengths.tolist()
        batches: list[list[int]] = []
        seen: set[int] = set()  # segments computed in an earlier micro-batch of the step
        here: set[int] = set()
        cost = 0.0
        for sample in sorted_samples(ids, starts, ends):
            new = [s for s in paths[sample] if s not in here]
            added = sum(rows[s] * (held_cost if s in seen else 1.0) for s in new)
            if lengths[sample] > max_tokens:  # its chunks before the last: held
                added -= (lengths[sample] - max_tokens) * (1.0 - held_cost)
            if batches and here and cost + added > max_tokens:
                seen |= here
                here, cost = set(), 0.0
                new = list(paths[sample])
                added = sum(rows[s] * (held_cost if s in seen else 1.0) for s in new)
                if lengths[sample] > max_tokens:
                    added -= (lengths[sample] - max_tokens) * (1.0 - held_cost)
                batches.append([])
            if not batches:
                batches.append([])
            batches[-1].append(sample)
            here |= set(new)
            cost += added
        return [sorted(batch) for batch in batches]


def shared_prefix_micro_batches(samples: Sequence[Any], max_tokens: int, *, min_shared: int = 1,
                                held_cost: float | None = None) -> list[list[int]]:
    """The samples' indices per micro-batch, each micro-batch at most `max_tokens` physical tokens
    (what its shared-prefix plan computes: each group's shared prefix once, each member's own tokens).
    Without `held_cost` each micro-batch is planned on its own (`plan_shared_prefix`) and a sample
    longer than `max_tokens` is refused by name (no micro-batch holds it); with it, the step is planned
    together (`plan_shared_prefix_step(..., max_tokens=max_tokens)`): a segment counted once per step,
    a held row at `held_cost` of a computed one (0 to 1), a sample longer than the budget in chunks."""
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)):
        raise TypeError(f"{NAME}: samples must be a list of samples (each a 1-D tensor or a list of ids), got "
                        f"{type(samples).__name__}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{NAME}: max_tokens must be an int >= 1, got {max_tokens!r}")
    if not isinstance(min_shared, int) or isinstance(min_shared, bool) or min_shared < 1:
        raise ValueError(f"{NAME}: min_shared must be an int >= 1 (the fewest leading tokens a group shares), "
                         f"got {min_shared!r}")
    if held_cost is not None and (isinstance(held_cost, bool) or not isinstance(held_cost, (int, float))
                                  or not 0.0 <= held_cost <= 1.0):
        raise ValueError(f"{NAME}: held_cost must be a number from 0 to 1 (a held row's bytes over a computed "
                         f"row's), or None to plan each micro-batch on its own, got {held_cost!r}")
    with collector_paused():
        values = [sample_ids(sample, i) for i, sample in enumerate(samples)]
        for i, sample in enumerate(values):
            if not sample:
                raise ValueError(f"{NAME}: samples[{i}] is empty")
            if held_cost is None and len(sample) > max_tokens:
                raise ValueError(f"{NAME}: samples[{i}] has {len(sample)} tokens, more than "
                                 f"max_tokens={max_tokens}: raise max_tokens, cut the sample, or plan the step "
                                 "together (held_cost=...), which trains it in chunks")
        if held_cost is not None:
            return step_micro_batches(values, max_tokens, min_shared, float(held_cost))
        return physical_micro_batches(values, max_tokens, min_shared)
