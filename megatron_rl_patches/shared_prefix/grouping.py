"""Groups of samples found by value: the samples' longest common leading tokens.

A group index a framework claims for its samples (GRPO's prompt index) is a hint and nothing more:
two samples share rows only when their leading tokens are equal. The samples are sorted by their
tokens; in that order the tokens a run of samples shares are the least of its neighbours' common
prefixes, and the partition of the sorted samples into runs that saves the most tokens (a run of g
samples sharing L tokens saves (g - 1) * L) is found exactly by dynamic programming. A sample equal
to another's prefix (an empty response, two identical samples) may lie wholly inside the shared
prefix: its rows are the prefix's, as its own forward would compute them."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """Samples (their indices, in the micro-batch's order) and the `shared` leading tokens they all
    hold (0 for a sample alone)."""

    members: tuple[int, ...]
    shared: int

    @property
    def saved(self) -> int:
        """Tokens the shared prefix saves: computed once instead of once per member."""
        return (len(self.members) - 1) * self.shared


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def find_groups(samples: Sequence[Sequence[int]], min_shared: int = 1) -> list[Group]:
    """The samples' groups by value, ordered by their first member; each group's members in the
    samples' order. A group shares at least `min_shared` tokens; a sample no other shares that many
    with is a group of its own (shared 0). Of partitions that save alike, the one found first (its last
    run the shortest). Deterministic: the same samples give the same groups."""
    order = sorted(range(len(samples)), key=lambda i: (tuple(samples[i]), i))
    # what order[j] shares with order[j + 1]
    adjacent = [common_length(samples[order[j]], samples[order[j + 1]]) for j in range(len(order) - 1)]
    best = [0] * (len(order) + 1)  # best[j]: most tokens saved by the first j sorted samples
    start = [0] * (len(order) + 1)  # where the last run of that best partition starts
    for end in range(1, len(order) + 1):
        best[end], start[end] = best[end - 1], end - 1  # order[end - 1] alone
        shared = None
        for first in range(end - 2, -1, -1):  # the run order[first:end]
            shared = adjacent[first] if shared is None else min(shared, adjacent[first])
            if shared < min_shared:
                break
            saved = best[first] + (end - 1 - first) * shared
            if saved > best[end]:
                best[end], start[end] = saved, first
    runs = []
    end = len(order)
    while end > 0:
        first = start[end]
        shared = min(adjacent[first:end - 1]) if end - first > 1 else 0
        runs.append(Group(tuple(sorted(order[first:end])), shared))
        end = first
    return sorted(runs, key=lambda group: group.members[0])
