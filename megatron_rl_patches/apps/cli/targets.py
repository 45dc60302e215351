"""Patch target modules for `list` and `doctor`: found without importing them, imported on request,
and the word the CLI shows for a status."""
from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from megatron_rl_patches.patching import records


def shown_status(status: records.PatchStatus) -> str:
    """The word `list` and `doctor` show: :attr:`PatchStatus.state` (`off`, `reverted`, `native`,
    `n/a` for a skipped target that is no problem), so `skipped` and `failed` always mean a
    problem. Display only: applied() and --json keep the status and its code."""
    return status.state


STATUS_HELP = textwrap.fill(
    "STATUS: applied; pending (its module is not imported yet); off (not selected or disabled); "
    "reverted (revert() removed it); native "
    "(megatron-core provides the feature); n/a (an optional alias this version lacks); skipped or "
    "failed (a problem: the reason says which).", 78
)


def find_module(name: str) -> tuple[bool, str | None]:
    """Whether module `name` can be found, without running any package __init__ not yet imported
    (importlib.util.find_spec would import the parents: megatron, torch...). -> (found, problem)."""
    parts = name.split(".")
    path = None
    for depth in range(1, len(parts) + 1):
        fullname = ".".join(parts[:depth])
        module = sys.modules.get(fullname)
        if module is not None:
            path = getattr(module, "__path__", None)
        else:
            try:
                spec = _find_spec_without_import(fullname, path)
            except Exception as exc:  # noqa: BLE001 - a broken finder: report, do not crash
                return False, f"looking for {fullname} failed: {type(exc).__name__}: {exc}"
            if spec is None:
                return False, f"{fullname} is not installed" if depth == 1 else f"{fullname} not found"
            path = spec.submodule_search_locations
        if depth < len(parts) and path is None:
            return False, f"{fullname} is a module, not a package"
    return True, None


def _find_spec_without_import(fullname: str, path: Any) -> Any:
    for finder in sys.meta_path:
        # wrapt's post-import finder resolves through importlib.util.find_spec (imports parents)
        if type(finder).__module__.startswith("wrapt"):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(fullname, path)
        if spec is not None:
            return spec
    return None


def import_targets(modules: Sequence[str]) -> dict[str, str]:
    """Import each installed module; returns module -> problem for those that failed."""
    problems = {}
    for module in modules:
        if not find_module(module)[0]:
            continue
        try:
            importlib.import_module(module)
        except records.PatchError as exc:  # strict mode: the post-import hook raised
            problems[module] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - a broken optional framework: report it, go on
            problems[module] = f"import failed: {type(exc).__name__}: {exc}"
    return problems
