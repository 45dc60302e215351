"""What a kind of teacher is to the entry grammar (`TeacherKind`): how its entries are written,
which entries are its own, its parser, its checks against the run, and what `doctor` finds
without loading anything. A framework's builder per kind lives with the framework
(slime: `integrations/megatron/teachers/teacher_builders.py`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl_patches.teachers.kinds.entry import RunFacts, TeacherEntry


def no_check(entry: TeacherEntry, facts: RunFacts) -> None:
    """A kind with nothing to check against the run."""


def no_problems(entry: TeacherEntry, facts: RunFacts) -> list[str]:
    """A kind `doctor` has nothing to ask of."""
    return []


@dataclass(frozen=True)
class TeacherKind:
    """One kind of teacher: its `name` (`TeacherEntry.kind`), `form` (how its entries are written,
    for errors and --help), `recognizes` (whether a stripped entry is its own: the first row of
    the table that says so parses it), `parse` (the entry -> its record; ValueError naming the
    entry), `check` (against the run, before anything loads; ValueError naming the entry and the
    setting) and `problems` (what loading it would fail on, found by `doctor` without loading)."""

    name: str
    form: str
    recognizes: Callable[[str], bool]
    parse: Callable[[str], TeacherEntry]
    check: Callable[[TeacherEntry, RunFacts], None] = no_check
    problems: Callable[[TeacherEntry, RunFacts], list[str]] = no_problems
