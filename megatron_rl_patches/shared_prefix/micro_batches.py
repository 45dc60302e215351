"""Micro-batches counted in physical tokens: a group's prefix once, then each member's own tokens.

A hand-written loop cuts its samples into micro-batches of at most `max_tokens` tokens as the model
will compute them under shared-prefix plans. A group stays whole in one micro-batch unless it alone
exceeds the budget; then it is cut into parts, each carrying the prefix again. Groups are placed
first-fit, largest first (fewer micro-batches than placing them in order), and every micro-batch
keeps its samples in their original order."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl_patches.shared_prefix.grouping import find_groups


def _values(sample: Any, index: int) -> list[int]:
    if isinstance(sample, torch.Tensor):
        if sample.dim() != 1 or sample.dtype.is_floating_point or sample.device.type == "meta":
            raise ValueError(f"shared_prefix_micro_batches: samples[{index}] must be a 1-D tensor of ids, got "
                             f"{tuple(sample.shape)} {sample.dtype} on {sample.device}")
        return [int(x) for x in sample.tolist()]
    if isinstance(sample, Sequence) and not isinstance(sample, (str, bytes)):
        return [int(x) for x in sample]
    raise TypeError(f"shared_prefix_micro_batches: samples[{index}] must be a 1-D tensor or a list of ids, got "
                    f"{type(sample).__name__}")


def shared_prefix_micro_batches(samples: Sequence[Any], max_tokens: int, *, min_shared: int = 1) -> list[list[int]]:
    """The samples' indices per micro-batch, each micro-batch at most `max_tokens` physical tokens
    (what its shared-prefix plan computes: each group's shared prefix once, each member's own tokens).
    A sample longer than `max_tokens` is refused by name (no micro-batch holds it)."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"shared_prefix_micro_batches: max_tokens must be an int >= 1, got {max_tokens!r}")
    values = [_values(sample, i) for i, sample in enumerate(samples)]
    for i, sample in enumerate(values):
        if not sample:
            raise ValueError(f"shared_prefix_micro_batches: samples[{i}] is empty")
        if len(sample) > max_tokens:
            raise ValueError(f"shared_prefix_micro_batches: samples[{i}] has {len(sample)} tokens, more than "
                             f"max_tokens={max_tokens}: raise max_tokens or cut the sample")
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
    bins: list[tuple[int, list[int]]] = []
    for cost, members in sorted(parts, key=lambda p: (-p[0], p[1][0])):
        for index, (used, held) in enumerate(bins):
            if used + cost <= max_tokens:
                bins[index] = (used + cost, held + members)
                break
        else:
            bins.append((cost, list(members)))
    return sorted((sorted(held) for _, held in bins), key=lambda held: held[0])
