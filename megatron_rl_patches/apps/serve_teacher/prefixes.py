"""A group's shared prefix, computed once (`SharedPrefixes`). The samples of one prompt (the same ids
before their response start: the prompt, and a privileged context placed before the response) are
a group. The first of a group to arrive is computed whole; the others wait for it and are then
computed reading the engine's prefix cache, so only their own tokens (and the prefix's last,
partly filled block) are computed again.

vLLM hands back no state for a position inside a cached prefix (those rows are never written:
they must never be read). A sample needs the states from its response start - 1 on; the ones that
fall inside its cached prefix depend only on ids the group shares, so they are taken from an
earlier member's full pass: the group's first, kept here (`keep`) from its response start - 1 to
its end. A sample whose cached rows it does not cover (its states dropped to bound memory, a
response agreeing with another member's past the first's, blocks cached by another prompt's sample)
is computed again without reading the cache: always the rows of a full pass. Standard library and torch only."""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch

KEPT_GROUPS = 64  # the groups whose states are kept (least recently used dropped first)


@dataclass(frozen=True)
class Kept:
    """A computed sample's `ids` and its states from position `first` to its end."""

    ids: tuple[int, ...]
    first: int
    states: torch.Tensor


class SharedPrefixes:
    """The groups in flight (their first member's turn) and the states kept per group."""

    def __init__(self, kept_groups: int = KEPT_GROUPS) -> None:
        self.kept_groups = kept_groups
        self.leaders: dict[tuple[int, ...], asyncio.Event] = {}
        self.kept: OrderedDict[tuple[int, ...], Kept] = OrderedDict()

    @asynccontextmanager
    async def turn(self, ids: list[int], start: int) -> AsyncIterator[None]:
        """Entered when the sample may run: at once for the first of its group (the others wait
        until it has been computed), at once for any sample of a group computed before."""
        key = tuple(ids[:start])
        while (leader := self.leaders.get(key)) is not None:
            await leader.wait()
        if key in self.kept:
            yield
            return
        done = self.leaders[key] = asyncio.Event()
        try:
            yield
        finally:
            del self.leaders[key]
            done.set()

    def rows(self, ids: list[int], start: int, cached: int) -> torch.Tensor | None:
        """The states of positions start - 1 ... cached - 1 (the ones inside the sample's cached
        prefix that it needs) from a kept member whose ids agree up to `cached`; an empty tensor
        when none is needed (None: needed and not kept)."""
        if cached <= start - 1:
            return torch.zeros(0)
        kept = self.kept.get(tuple(ids[:start]))  # kept under the same `start` ids: its first row is start - 1
        if kept is None or len(kept.ids) < cached or kept.ids[:cached] != tuple(ids[:cached]):
            return None
        self.kept.move_to_end(tuple(ids[:start]))
        return kept.states[start - 1 - kept.first: cached - kept.first]

    def keep(self, ids: list[int], start: int, states: torch.Tensor) -> None:
        """`states` [len(ids) - start + 1, H]: the sample's positions start - 1 ... end, kept for its
        group where the group keeps none yet."""
        key = tuple(ids[:start])
        if key not in self.kept:
            self.kept[key] = Kept(tuple(ids), start - 1, states)
        self.kept.move_to_end(key)
        while len(self.kept) > self.kept_groups:
            self.kept.popitem(last=False)
