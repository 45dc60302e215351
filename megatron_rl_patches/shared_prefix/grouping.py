"""Groups of samples found by value: the samples' longest common leading tokens.

A group index a framework claims for its samples (GRPO's prompt index) is a hint and nothing more:
two samples share rows only when their leading tokens are equal. The samples are sorted by their
tokens; in that order the tokens a run of samples shares are the least of its neighbours' common
prefixes, and the partition of the sorted samples into runs that saves the most tokens (a run of g
samples sharing L tokens saves (g - 1) * L) is found exactly by dynamic programming. A sample equal
to another's prefix (an empty response, two identical samples) may lie wholly inside the shared
prefix: its rows are the prefix's, as its own forward would compute them.

The dynamic programme takes O(n log n) steps for n samples, not the O(n^2) of trying every run that
ends at each sample (16,384 samples of one prompt: 18.7 s before): see `runs_saving_most`. Python's
cyclic garbage collector is paused while the groups are found (`collector_paused`): the work makes
no reference cycles, and a full collection in it would walk every sample the caller holds (16,384
lists of 1,152 ints: 19M references) once per so many new objects, a cost that grew as n^2."""
from __future__ import annotations

import gc
import sys
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal


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


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (objects are still freed by their counts), back
    on after, also on an error, unless the caller had it off already."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _big_endian(rows: Sequence[array], signed: bool) -> list[bytes] | None:
    """Copies of `rows` (arrays of one item size) as big-endian bytes, or None where `signed` and a
    value is negative (its bytes would sort after the positive ones')."""
    keys = []
    for sample in rows:
        row = sample[:]
        if sys.byteorder == "little":
            row.byteswap()
        key = row.tobytes()
        if signed and not key[::row.itemsize].isascii():  # a first byte >= 128: a sign bit set
            return None
        keys.append(key)
    return keys


def _packed(samples: Sequence[Sequence[int]]) -> tuple[list[bytes], int] | None:
    """Each sample as big-endian unsigned bytes of one width (4 or 8 per token), whose byte order
    is the tokens' order (so sorting and common prefixes run in C), or None where an id is negative
    or past 2**64 - 1 (then the samples are compared as lists). Samples given as arrays of one item
    size ('I', or 'q' / 'Q') are copied as they are."""
    codes = {sample.typecode if isinstance(sample, array) else "" for sample in samples}
    if codes and (codes <= {"I"} or codes <= {"q", "Q"}):
        keys = _big_endian(samples, signed="q" in codes)  # type: ignore[arg-type]
        if keys is not None:
            return keys, 4 if codes == {"I"} else 8
    code: Literal["I", "Q"]
    for code in ("I", "Q"):
        try:
            rows = [array(code, sample) for sample in samples]
        except (OverflowError, TypeError):
            continue
        keys = _big_endian(rows, signed=False)
        return (keys, rows[0].itemsize) if keys is not None else None
    return None


def _common_bytes(a: bytes, b: bytes, width: int) -> int:
    """How many leading tokens (of `width` bytes each) `a` and `b` share: a binary search of prefix
    comparisons (memcmp against a view of `b`: nothing copied), not a loop over the tokens."""
    low, high = 0, min(len(a), len(b)) // width  # a and b share `low` tokens, not `high + 1`
    view = memoryview(b)
    if not a.startswith(view[:width]):  # not even the first token (samples of other prompts): no search
        return 0
    if a.startswith(view[:high * width]):
        return high
    high -= 1
    while low < high:
        middle = (low + high + 1) // 2
        if a.startswith(view[:middle * width]):
            low = middle
        else:
            high = middle - 1
    return low


def sorted_with_neighbours(samples: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """The samples' indices sorted by their tokens (ties by index) and what each sorted sample
    shares with the next."""
    packed = _packed(samples)
    if packed is None:
        order = sorted(range(len(samples)), key=lambda i: list(samples[i]))
        return order, [common_length(samples[order[j]], samples[order[j + 1]]) for j in range(len(order) - 1)]
    keys, width = packed
    # What every sample shares (the common prefix of the least and the greatest key: linear) is cut off
    # before sorting: samples of one prompt then compare their responses, not the prompt again and again
    # (n log n comparisons of the whole prompt grew faster than 4x for 4x the samples).
    shared = _common_bytes(min(keys), max(keys), width) if len(keys) > 1 else 0
    if shared:
        keys = [key[shared * width:] for key in keys]
    order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: ties by index
    return order, [shared + _common_bytes(keys[order[j]], keys[order[j + 1]], width) for j in range(len(order) - 1)]


class _Hull:
    """The upper convex hull of points (j, best[j]) with j increasing: max(best[j] - slope * j) in
    O(log n), the rightmost j among ties."""

    def __init__(self, j: int, value: int, tally: list[int]) -> None:
        self.points: deque[tuple[int, int]] = deque([(j, value)])
        self.tally = tally

    @staticmethod
    def _inside(a: tuple[int, int], b: tuple[int, int], c: tuple[int, int]) -> bool:
        """b (between a and c) on or under the segment ac: never the only maximum."""
        return (b[1] - a[1]) * (c[0] - a[0]) <= (c[1] - a[1]) * (b[0] - a[0])

    def append(self, point: tuple[int, int]) -> None:
        points = self.points
        while len(points) > 1 and self._inside(points[-2], points[-1], point):
            points.pop()
            self.tally[0] += 1
        points.append(point)
        self.tally[0] += 1

    def prepend(self, point: tuple[int, int]) -> None:
        points = self.points
        while len(points) > 1 and self._inside(point, points[0], points[1]):
            points.popleft()
            self.tally[0] += 1
        points.appendleft(point)
        self.tally[0] += 1

    def absorb_left(self, left: _Hull) -> _Hull:
        """The hull of `left`'s points (all left of this hull's) and this hull's; the smaller moved."""
        if len(left.points) > len(self.points):
            for point in self.points:
                left.append(point)
            return left
        for point in reversed(left.points):
            self.prepend(point)
        return self

    def best(self, slope: int) -> tuple[int, int]:
        """(max of value - slope * j, its rightmost j)."""
        points = self.points
        low, high = 0, len(points) - 1  # the first vertex whose next edge falls below `slope`
        while low < high:
            self.tally[0] += 1
            middle = (low + high) // 2
            (j0, v0), (j1, v1) = points[middle], points[middle + 1]
            if v1 - v0 >= slope * (j1 - j0):
                low = middle + 1
            else:
                high = middle
        j, value = points[low]
        return value - slope * j, j


class _Lines:
    """The upper envelope of lines (slope, intercept, j) pushed with rising slopes and popped last in
    first out (each push recorded so a pop restores what it overwrote): the max at x in O(log n), the
    latest line among ties."""

    def __init__(self, tally: list[int]) -> None:
        self.tally = tally
        self.lines: list[tuple[int, int, int]] = []
        self.size = 0
        self.undo: list[tuple[int, tuple[int, int, int] | None, int]] = []

    @staticmethod
    def _useless(a: tuple[int, int, int], b: tuple[int, int, int], c: tuple[int, int, int]) -> bool:
        """b (slope between a's and c's) never above both a and c: a meets c no later than a meets b."""
        return (c[1] - a[1]) * (b[0] - a[0]) >= (b[1] - a[1]) * (c[0] - a[0])

    def push(self, line: tuple[int, int, int]) -> None:
        lines = self.lines
        low, high = 1, self.size  # the first line `line` makes useless (self.size: none)
        while low < high:
            self.tally[0] += 1
            middle = (low + high) // 2
            if self._useless(lines[middle - 1], lines[middle], line):
                high = middle
            else:
                low = middle + 1
        position = low if self.size else 0
        self.undo.append((position, lines[position] if position < len(lines) else None, self.size))
        if position < len(lines):
            lines[position] = line
        else:
            lines.append(line)
        self.size = position + 1

    def pop(self) -> None:
        position, old, size = self.undo.pop()
        if old is not None:
            self.lines[position] = old
        self.size = size

    def clear(self) -> None:
        self.size = 0
        self.undo.clear()

    def best(self, x: int) -> tuple[int, int]:
        """(max of slope * x + intercept, that line's j) over at least one line."""
        lines = self.lines
        low, high = 0, self.size - 1  # the last line not below its predecessor at x
        while low < high:
            self.tally[0] += 1
            middle = (low + high + 1) // 2
            a, b = lines[middle - 1], lines[middle]
            if b[0] * x + b[1] >= a[0] * x + a[1]:
                low = middle
            else:
                high = middle - 1
        slope, intercept, j = lines[low]
        return slope * x + intercept, j


def runs_saving_most(adjacent: Sequence[int], min_shared: int = 1, steps: list[int] | None = None) -> list[int]:
    """The partition of n sorted samples (`adjacent[j]`: what sample j shares with j + 1) into runs
    that saves the most: the first sample of each run, in order. A run of samples first..last shares
    min(adjacent[first:last]) tokens (at least `min_shared`) and saves (last - first) times that. Of
    partitions that save alike, the one whose last run is the shortest (then the same rule for the
    samples before it).

    best[e] (the most the first e samples save) is the max of best[e - 1] (sample e - 1 alone) and,
    over runs first..e - 1, best[first] + (e - 1 - first) * shared(first). The firsts are kept on a
    stack of segments of equal `shared` h (rising up the stack, as in the largest-rectangle stack);
    a segment's best is max over its firsts of (best[first] - first * h) + (e - 1) * h: a line in e
    whose slope h and intercept hold until the segment is merged into one of a lower h (a convex hull
    of (first, best[first]) answers the intercept at the merge; the smaller hull moves). The lines
    of the stack form an upper envelope answered by binary search. Each step O(log n) amortised.
    Ties as the quadratic programme broke them (the largest first among equal savings): a hull drops
    only points on or under a chord (never the rightmost of its maxima at any slope), the envelope
    only lines never strictly above both neighbours (never the latest of its maxima), and both
    queries take the right one of two equal candidates.
    `steps`, where given, gets one count per inner step (hull and envelope moves): the growth a test
    checks."""
    n = len(adjacent) + 1
    best = [0] * (n + 1)
    start = [0] * (n + 1)
    tally = [0]
    segments: list[tuple[int, _Hull]] = []  # (shared h, hull of its firsts), h rising up the stack
    lines = _Lines(tally)
    for last in range(n):  # the runs ending at sample `last`: best[last + 1]
        best[last + 1], start[last + 1] = best[last], last
        if last == 0:
            continue
        shared = adjacent[last - 1]
        if shared < min_shared:  # no run holds both last - 1 and last
            segments.clear()
            lines.clear()
            continue
        hull = _Hull(last - 1, best[last - 1], tally)
        while segments and segments[-1][0] >= shared:
            hull = hull.absorb_left(segments.pop()[1])
            lines.pop()
        intercept, first = hull.best(shared)
        segments.append((shared, hull))
        lines.push((shared, intercept, first))
        value, first = lines.best(last)
        if value > best[last + 1]:
            best[last + 1], start[last + 1] = value, first
    if steps is not None:
        steps.append(tally[0] + n)
    firsts = []
    end = n
    while end > 0:
        firsts.append(start[end])
        end = start[end]
    return firsts[::-1]


def find_groups(samples: Sequence[Sequence[int]], min_shared: int = 1) -> list[Group]:
    """The samples' groups by value, ordered by their first member; each group's members in the
    samples' order. A group shares at least `min_shared` tokens; a sample no other shares that many
    with is a group of its own (shared 0). Of partitions that save alike, the one found first (its last
    run the shortest). Deterministic: the same samples give the same groups."""
    if not samples:
        return []
    with collector_paused():
        order, adjacent = sorted_with_neighbours(samples)
        firsts = runs_saving_most(adjacent, min_shared)
        runs = []
        for first, end in zip(firsts, [*firsts[1:], len(order)]):
            shared = min(adjacent[first:end - 1]) if end - first > 1 else 0
            runs.append(Group(tuple(sorted(order[first:end])), shared))
        return sorted(runs, key=lambda group: group.members[0])
