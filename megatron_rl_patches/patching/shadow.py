"""Entries of a mapping replaced for one block and put back after it (`replaced`): instance
attributes that shadow a module's own (`shadowed`: the output-layer stop of the backports,
layer-major's decoder steps), environment variables a block's child processes inherit
(`testing.environ`, the benchmarks' allocator setting). A leaf: imports nothing of ours."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any


@contextlib.contextmanager
def replaced(mapping: MutableMapping[str, Any], values: Mapping[str, Any]) -> Iterator[None]:
    """`values` set in `mapping` for the block; each key's earlier value, or its absence, restored after."""
    missing = object()
    saved = {name: mapping.get(name, missing) for name in values}
    mapping.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                mapping.pop(name, None)
            else:
                mapping[name] = value


def shadowed(module: Any, **attributes: Any) -> contextlib.AbstractContextManager[None]:
    """`attributes` set in `module.__dict__` for the block; what the instance held before is put
    back. The class is untouched, and for an nn.Module, which looks in `_modules` only when normal
    lookup fails, an entry shadows a submodule or method without unregistering it (parameters,
    state dict and hooks unchanged)."""
    return replaced(module.__dict__, attributes)
