"""ResidencyBudget: one cap on the device weight bytes of several swap/stream builds (teachers);
units are brought in on demand and evicted least-recently-used so the sum never exceeds it."""
from __future__ import annotations

import itertools
import numbers
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from megatron_rl_patches.inference.residency.units import Unit


class Member(Protocol):
    """What the budget needs of a build it caps (placement.Residency is one): its units kept on the
    device after use, and a way to give one of them back."""

    def cached_units(self) -> list[Unit]: ...

    def evict(self, unit: Unit) -> None: ...


class ResidencyBudget:
    """A byte cap shared by the builds given it as `budget=`: `in_use` (device weight bytes of
    all of them now) never exceeds `bytes`; `peak` is the highest `in_use` seen."""

    def __init__(self, bytes: int):  # noqa: A002 - the public keyword is `bytes`
        if isinstance(bytes, bool) or not isinstance(bytes, numbers.Integral) or bytes <= 0:
            raise ValueError(
                f"ResidencyBudget(bytes=...) must be a positive int number of device bytes, got {bytes!r}"
            )
        self.bytes: int = int(bytes)
        self.in_use: int = 0
        self.peak: int = 0
        self.evictions: int = 0
        self._members: weakref.WeakSet[Member] = weakref.WeakSet()  # a dropped model leaves
        self._clock: Iterator[int] = itertools.count(1)

    def __repr__(self) -> str:
        return f"ResidencyBudget(bytes={self.bytes}, in_use={self.in_use}, peak={self.peak})"

    def join(self, member: Member) -> None:
        self._members.add(member)

    def tick(self) -> int:
        """A use stamp: larger = more recently used."""
        return next(self._clock)

    def charge(self, nbytes: int) -> None:
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)

    def make_room(self, nbytes: int, requester: Any) -> bool:
        """Evict cached (idle) units, least recently used first, until `nbytes` more fit; False
        when they cannot (everything left on the device is in use)."""
        while self.in_use + nbytes > self.bytes:
            victim = self._lru_cached()
            if victim is None:
                return False
            member, unit = victim
            member.evict(unit)
            self.evictions += 1
        return True

    def _lru_cached(self) -> tuple[Member, Unit] | None:
        candidates = [
            (unit.last_used, id(unit), member, unit) for member in self._members for unit in member.cached_units()
        ]
        if not candidates:
            return None
        _, _, member, unit = min(candidates, key=lambda c: (c[0], c[1]))
        return member, unit

    def as_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "in_use": self.in_use, "peak": self.peak, "evictions": self.evictions}
