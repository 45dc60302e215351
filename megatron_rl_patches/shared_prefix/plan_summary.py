"""A sharing plan as a reader looks at it: one line of figures (`SharedPrefixPlan.__repr__`, what
`print(plan)` shows instead of every tensor) and its segments as a tree (`SharedPrefixPlan.tree()`:
each segment's rows, the samples holding it and the segments under it, at every depth: what
`plan.groups` shows of the top level only).

Both are read from the plan's own maps (each sample's rows through `logical_rows` to their
segments), so they show what the model computes, not what was asked. `plan` is a `SharedPrefixPlan`
(typed `Any` here: plan.py imports this module, never the other way round)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PrefixNode:
    """One segment of a sharing plan: its physical rows [`start`, `start + length`), the position
    its first token holds in each sample holding it (`position`), those samples (their indices in the
    micro-batch, ascending) and the segments under it (`children`, in physical order). A segment of
    two or more samples is computed once for all of them."""

    start: int
    length: int
    position: int
    samples: tuple[int, ...]
    children: tuple[PrefixNode, ...]

    def lines(self, indent: int = 0) -> list[str]:
        """This segment and every segment under it, one line each, two spaces deeper per level."""
        end = self.start + self.length - 1
        rows = f"row {self.start}" if self.length == 1 else f"rows {self.start}-{end}"
        tokens = "1 token" if self.length == 1 else f"{self.length} tokens"
        own = [f"{'  ' * indent}{rows} ({tokens} from position {self.position}): {samples_text(self.samples)}"]
        return own + [line for child in self.children for line in child.lines(indent + 1)]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def samples_text(samples: Sequence[int]) -> str:
    """`samples` in words, runs of consecutive indices as ranges: "sample 3", "samples 0-7, 9"."""
    runs: list[list[int]] = []
    for index in samples:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return f"{'sample' if len(samples) == 1 else 'samples'} {', '.join(parts)}"


def segment_samples(plan: Any) -> list[tuple[int, ...]]:
    """Per segment of `plan`, the samples whose tokens it computes (none for padding)."""
    count = int(plan.segment_starts.numel())
    samples = plan.stats.samples
    bounds = plan.sequence_bounds[:samples + 1]
    if samples == 0 or bounds.numel() < samples + 1:
        return [()] * count
    lengths = bounds.diff()
    owner = torch.repeat_interleave(torch.arange(samples), lengths)
    rows = plan.logical_rows[int(bounds[0]):int(bounds[-1])]
    pairs = torch.unique(torch.stack([plan.segments[rows], owner], dim=1), dim=0).tolist()
    held: list[list[int]] = [[] for _ in range(count)]
    for segment, sample in pairs:
        held[segment].append(sample)
    return [tuple(one) for one in held]


def plan_tree(plan: Any) -> tuple[PrefixNode, ...]:
    """The segments of `plan` that hold samples' tokens, as trees under the root (padding left out)."""
    held = segment_samples(plan)
    starts, lengths = plan.segment_starts.tolist(), (plan.segment_ends - plan.segment_starts).tolist()
    parents = plan.segment_parents.tolist()
    positions = plan.positions[plan.segment_starts].tolist()  # a segment is never empty
    children: list[list[int]] = [[] for _ in starts]
    tops: list[int] = []
    for segment, parent in enumerate(parents):
        if not held[segment]:
            continue  # padding: no sample's token
        (children[parent] if parent >= 0 else tops).append(segment)

    def node(segment: int) -> PrefixNode:
        return PrefixNode(start=starts[segment], length=lengths[segment], position=positions[segment],
                          samples=held[segment], children=tuple(node(child) for child in children[segment]))

    return tuple(node(segment) for segment in tops)


def plan_summary(plan: Any) -> str:
    """One line: the samples (sharing, alone), the tokens packed and computed, the padding rows and
    the number of segments at each depth (depth 0: under the root)."""
    stats = plan.stats
    held = segment_samples(plan)
    depths = [depth for depth, samples in zip(plan.segment_depths.tolist(), held) if samples]
    per_depth = [depths.count(depth) for depth in range(max(depths) + 1)] if depths else []
    fewer = f"{stats.logical_tokens / stats.physical_tokens:.2f}x fewer" if stats.physical_tokens else "none"
    groups = "1 group" if stats.groups == 1 else f"{stats.groups} groups"
    padding = "1 padding row" if plan.padding_rows == 1 else f"{plan.padding_rows} padding rows"
    return (f"SharedPrefixPlan({stats.samples} samples: {stats.shared_samples} in {groups} sharing a prefix, "
            f"{stats.alone} alone; tokens {stats.logical_tokens} packed, {stats.physical_tokens} computed ({fewer}), "
            f"{padding}; segments by depth: {', '.join(map(str, per_depth)) or 'none'})")
