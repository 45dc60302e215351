"""The residency modes a frozen build may name, defined once: the builds (residency/placement.py),
the `memory --residency` planner (sizing/residency_plan.py) and `inference.RESIDENCY_MODES` use this
tuple. Imports nothing: the planner runs without torch."""
from __future__ import annotations

RESIDENCY_MODES = ("resident", "swap", "stream")
