"""`megatron-rl-patches list`: every patch record, its target, version range and status.

(Named `listing`, not `list`: a submodule binds its name in the package, shadowing the builtin.)
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from megatron_rl_patches.apps.cli._common import OK, PROBLEM, UsageError, say
from megatron_rl_patches.apps.cli.targets import STATUS_HELP, import_targets, shown_status
from megatron_rl_patches.integrations import default_registry
from megatron_rl_patches.patching import env
from megatron_rl_patches.patching.records import PatchError
from megatron_rl_patches.patching.registry import patch_version


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = f"{parser.description}\n\n{STATUS_HELP}"
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list (status: applied/pending/skipped/failed, with a reason code)")
    parser.add_argument(
        "--apply",
        action="store_true",
        help="first apply what the environment selects, as the start-up file does in every process",
    )
    parser.add_argument(
        "--import",
        dest="import_targets",
        action="store_true",
        help="then import every installed target module so pending patches land (imports megatron: slow)",
    )


def _apply_environment_selection() -> int:
    """Apply as the start-up file would; a bad selection is a usage error, strict failures a problem."""
    if not env.is_enabled():
        print(f"note: {env.SELECT} is not set: start-up applies nothing", file=sys.stderr)
        return OK
    try:
        default_registry().apply()
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    except PatchError as exc:
        say("list", f"{type(exc).__name__}: {exc}")
        return PROBLEM
    return OK


def rows() -> list[dict[str, Any]]:
    """One JSON-ready row per (patch, target) of the default registry."""
    return [
        {
            "name": patch.name,
            "target": patch.target,
            "requires": patch.requires,
            "versions": patch.versions,
            "installed": patch_version(patch),
            "description": patch.description,
            "status": status.status,
            "code": status.code,
            "reason": status.reason,
            "shown": shown_status(status),
        }
        for patch, status in default_registry().entries()
    ]


def format_rows(table: list[dict[str, Any]]) -> str:
    """The text table: one block per (patch, target), with the word `shown_status` gives."""
    width = max((len(row["name"]) for row in table), default=4)
    lines = [f"{'PATCH':<{width}}  {'STATUS':<8}  TARGET"]
    pad = " " * (width + 12)
    for row in table:
        if row["requires"]:
            found = row["installed"] or "not installed"
            versions = f"{row['requires']} {row['versions'] or 'any version'} (in use: {found})"
        else:
            versions = "no version guard (the parameter list is checked)"
        lines.append(f"{row['name']:<{width}}  {row['shown']:<8}  {row['target']}")
        lines.append(f"{pad}{row['description']}")
        lines.append(f"{pad}{versions}")
        if row["reason"]:
            lines.append(f"{pad}{row['shown']}: {row['reason']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.apply and _apply_environment_selection() != OK:
        return PROBLEM
    import_problems: dict[str, str] = {}
    if args.import_targets:
        import_problems = import_targets(list(dict.fromkeys(p.module for p in default_registry().patches())))
    table = rows()
    if args.json:
        print(json.dumps([{k: v for k, v in row.items() if k != "shown"} for row in table], indent=2))
    else:
        print(format_rows(table))
    for module, problem in import_problems.items():
        say("list", f"{module}: {problem}")
    return PROBLEM if import_problems else OK
