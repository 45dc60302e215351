"""Module-level `__getattr__` that imports a public name's defining module on first access, so
importing a package stays cheap (no torch, megatron or wrapt until a name that needs them)."""
from __future__ import annotations

import importlib

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def lazy_getattr(package: str, names: dict[str, str], namespace: dict) -> Callable[[str], Any]:
    """`names` maps a public name to the module defining it (absolute, or relative to `package`
    when it has no dot); resolved values are cached in `namespace` (the package's globals())."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = module if "." in module else f"{package}.{module}"
        value = getattr(importlib.import_module(target), name)
        namespace[name] = value
        return value

    return __getattr__
