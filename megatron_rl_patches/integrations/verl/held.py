"""What the package keeps for verl on verl's own objects (`held`): an attribute of the object that
asks for it (its teacher client in the agent loop, its engine on the trainer), so it lives and goes
with that object and no state is shared through a module or a context variable. Each such object
is used from one thread (the agent loop's event loop, the trainer's step): nothing to lock."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

PREFIX = "megatron_rl_patches_"
T = TypeVar("T")


def held(owner: Any, name: str, make: Callable[[], T]) -> T:
    """`owner`'s `name` (made by `make` on first use, kept as the attribute PREFIX + name)."""
    attribute = PREFIX + name
    value = getattr(owner, attribute, None)
    if value is None:
        value = make()
        setattr(owner, attribute, value)
    return value


def peek(owner: Any, name: str) -> Any:
    """`owner`'s `name` if it was made (`held`), else None; makes nothing."""
    return getattr(owner, PREFIX + name, None)
