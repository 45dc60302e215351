"""Instance attributes that shadow a module's own for one block (a leaf: imports nothing of ours)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def shadowed(module: Any, **attributes: Any) -> Iterator[None]:
    """`attributes` set in `module.__dict__` for the block; what the instance held before is put
    back. The class is untouched, and for an nn.Module, which looks in `_modules` only when normal
    lookup fails, an entry shadows a submodule or method without unregistering it (parameters,
    state dict and hooks unchanged)."""
    missing = object()
    saved = {name: module.__dict__.get(name, missing) for name in attributes}
    module.__dict__.update(attributes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value
