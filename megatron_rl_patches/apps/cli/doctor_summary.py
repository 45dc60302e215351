"""`doctor`'s summary, printed before its ~50 target lines: what applies at start-up in a process of
this interpreter started with this environment, which patches have their targets here and which
frameworks are not installed (their patches are off), and how many problems were found."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.apps.cli._common import PROG
from megatron_rl_patches.patching import env


def summary_of(report: dict[str, Any]) -> dict[str, Any]:
    """The summary of a `doctor` report (its environment, start-up files, targets and problems)."""
    environment, startup = report["environment"], report["startup"]
    resolved = environment["resolved"] or []
    has_hook = startup["pth_installed"] or startup["bootstrap_ran"]
    applies = resolved if environment["enabled_at_startup"] and has_hook else []
    if not environment["enabled_at_startup"]:
        state = "unset" if environment["variables"][env.SELECT] is None else "off"
        why = (f"{env.SELECT} is {state}; patches apply where code calls apply(), or under `{PROG} run -- "
               "COMMAND`")
    elif environment["error"]:
        why = f"{env.SELECT}'s selection is refused (see the problems)"
    elif not has_hook:
        why = (f"{env.SELECT} selects {len(resolved)} patch{'es' if len(resolved) != 1 else ''}, but this "
               "interpreter has no start-up file (see the problems)")
    else:
        why = ""
    found: dict[str, list[bool]] = {}
    for target in report["targets"]:
        found.setdefault(target["name"], []).append(target["module_found"])
    missing = [t["module_problem"].split(" ")[0] for t in report["targets"] if t["module_problem"]]
    return {
        "applies_at_startup": applies,
        "why": why,
        "every_target_here": [name for name, here in found.items() if all(here)],
        "some_targets_here": [name for name, here in found.items() if any(here) and not all(here)],
        "no_target_here": [name for name, here in found.items() if not any(here)],
        "not_installed": list(dict.fromkeys(missing)),
        "problems": len(report["problems"]),
    }


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as `doctor` prints it first: at most six lines."""
    applies = ", ".join(summary["applies_at_startup"])
    if applies:
        said = applies
    elif "selects" in summary["why"]:  # a selection that does not apply here: the reason is the news
        said = f"nothing: {summary['why']}"
    else:
        said = f"nothing ({summary['why']})"
    lines = ["summary:", f"  applies at start-up: {said}"]
    lines.append(f"  patches with their targets here: {_names(summary['every_target_here'])}; in part: "
                 f"{_names(summary['some_targets_here'])}")
    if summary["no_target_here"]:
        lines.append(f"  patches off here (no target module found): {len(summary['no_target_here'])}; not found: "
                     f"{', '.join(summary['not_installed'])}")
    count = summary["problems"]
    lines.append(f"  problems found: {count} (listed at the end)" if count else "  problems found: none")
    return lines


def _names(names: list[str]) -> str:
    return ", ".join(names) or "none"
