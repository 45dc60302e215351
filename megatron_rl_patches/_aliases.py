"""Module paths that moved: the old name imports the new module itself (the same object, so an
attribute set through either name is seen through both). A package lists its moved children
with :func:`install`; the paths users type keep working silently, the others warn once (a
DeprecationWarning at the first import; later imports find the module in `sys.modules`).

A leaf module: it imports nothing of ours, so every room may use it. Moving a file is a
`git mv` plus one row in its package's table, never a stub file at the old path.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import warnings

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from types import ModuleType
    from typing import Any

DEPRECATED = "{old} moved to {new}: import the new path (the old one is deprecated and will go)"

_moved: dict[str, tuple[str, bool]] = {}  # old path -> (new path, warns)
_lock = threading.Lock()


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a throwaway module: exec_module puts the real one in its place

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        new, warns = _moved[old]
        if warns:
            warnings.warn(DEPRECATED.format(old=old, new=new), DeprecationWarning, stacklevel=_importer_level())
        # the import system returns what sys.modules holds under the old name after this call
        sys.modules[old] = importlib.import_module(new)


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _moved:
            return None
        return importlib.machinery.ModuleSpec(fullname, _LOADER)


_LOADER = _AliasLoader()
_FINDER = _AliasFinder()


def _importer_level() -> int:
    """warn()'s stack level of the code that wrote the import: warn() steps over importlib's
    bootstrap frames itself; this counts the others up to the first frame outside importlib."""

    def bootstrap(frame: Any) -> bool:
        return "importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename

    frame: Any = sys._getframe(1)  # exec_module, which calls warn()
    level = 1
    while frame is not None and (frame.f_code.co_filename == __file__ or "importlib" in frame.f_code.co_filename):
        frame = frame.f_back
        while frame is not None and bootstrap(frame):
            frame = frame.f_back
        level += 1
    return level


def install(package: str, moved: Mapping[str, str], silent: Sequence[str] = ()) -> None:
    """Make `package.<old>` import `moved[old]` (an absolute module path); names in `silent` are
    paths users type (a command line, a config file) and do not warn."""
    with _lock:
        for old, new in moved.items():
            _moved[f"{package}.{old}"] = (new, old not in silent)
        if _FINDER not in sys.meta_path:
            sys.meta_path.append(_FINDER)  # after the path finders: a real module always wins


def moved_paths() -> dict[str, tuple[str, bool]]:
    """Every installed alias: old path -> (new path, whether importing it warns)."""
    return dict(_moved)
