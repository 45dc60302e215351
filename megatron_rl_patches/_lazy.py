"""A package's lazy public face from one table: `lazy_names` reads which module defines which public
names, `lazy_getattr` is the module-level `__getattr__` that imports a name's defining module on
first access, so importing a package stays cheap (no torch, megatron or wrapt until a name that
needs them). A public name that was renamed keeps its old name for a release (`renamed`: old ->
new), which warns once (DeprecationWarning) and gives the new name's value."""
from __future__ import annotations

import importlib
import warnings

RENAMED = "{package}.{old} is now {new}: use the new name (the old one is deprecated and will go)"

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def lazy_names(table: str) -> dict[str, str]:
    """`table` has a line per module: `module: Name other_name ...` (the module absolute, or relative
    to the package when it has no dot; an indented line without a colon goes on naming the module
    above; `#` starts a comment). Returns public name -> module, in the table's order."""
    names: dict[str, str] = {}
    module = None
    for line in table.splitlines():
        head, colon, listed = line.partition("#")[0].rpartition(":")
        if colon:
            module = head.strip()
        elif not listed.strip():
            continue
        if not module:
            raise ValueError(f"lazy_names: the line {line!r} names no module; write `module: Name ...`")
        for name in listed.split():
            if name in names:
                raise ValueError(f"lazy_names: {name!r} is listed under both {names[name]!r} and {module!r}; "
                                 f"list each public name under the one module that defines it")
            names[name] = module
    return names


def lazy_getattr(package: str, names: dict[str, str], namespace: dict,
                 renamed: dict[str, str] | None = None) -> Callable[[str], Any]:
    """`names` maps a public name to the module defining it (absolute, or relative to `package`
    when it has no dot); resolved values are cached in `namespace` (the package's globals()).
    `renamed`: a former public name -> its name in `names` (one warning, then cached)."""

    def __getattr__(name: str) -> Any:
        if renamed and name in renamed:
            warnings.warn(RENAMED.format(package=package, old=name, new=renamed[name]), DeprecationWarning,
                          stacklevel=2)
            value = __getattr__(renamed[name])
            namespace[name] = value
            return value
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = module if "." in module else f"{package}.{module}"
        value = getattr(importlib.import_module(target), name)
        namespace[name] = value
        return value

    return __getattr__
