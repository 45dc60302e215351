"""The residency modes a frozen build may name, defined once for every room: the builds, the
`memory --residency` planner, the roles variable (patching/env.py) and slime's OPD variable. A leaf
module: it imports nothing, so the planner and the environment readers run without torch."""
from __future__ import annotations

RESIDENCY_MODES = ("resident", "swap", "stream")


def check_residency(value: object, what: str = "residency") -> str:
    """`value` when it names a residency mode; a ValueError naming `what` and the modes otherwise."""
    if value not in RESIDENCY_MODES:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, RESIDENCY_MODES))}, got {value!r}")
    return str(value)
