"""What a kind of teacher is to the entry grammar (`TeacherKind`): how its entries are written,
which entries are its own, its parser, its checks against the run, what `doctor` finds without
loading anything, and its framework-free builder where it has one (`build`: a served teacher
needs no framework; an in-process kind is built by the host: `teachers.build`; slime's host builds
every kind through `integrations/megatron/opd/teacher_builders.py`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.teachers.entry import RunFacts, TeacherEntry


def no_check(entry: TeacherEntry, facts: RunFacts) -> None:
    """A kind with nothing to check against the run."""


def no_problems(entry: TeacherEntry, facts: RunFacts) -> list[str]:
    """A kind `doctor` has nothing to ask of."""
    return []


@dataclass(frozen=True)
class TeacherKind:
    """One kind of teacher: its `name` (`TeacherEntry.kind`), `form` (how its entries are written,
    for errors and --help), `recognizes` (whether a stripped entry is its own: the first row of
    the table that says so parses it), `parse` ((the entry, how every message names it: the
    setting it came in, `options.entry_named`) -> its record; ValueError naming the entry so; its
    user or password refused where it came in, not here), `check` (against the run, before
    anything loads; ValueError naming the entry and the setting), `problems` (what loading it would
    fail on, found by `doctor` without loading), `report` (where a kind asks something: its
    problems and what it checked that held, for `doctor`) and `build` ((entry, host, options) ->
    the teacher, framework-free; None: a kind loaded in process, which the host builds:
    `teachers.build.build_teachers`)."""

    name: str
    form: str
    recognizes: Callable[[str], bool]
    parse: Callable[[str, str], TeacherEntry]
    check: Callable[[TeacherEntry, RunFacts], None] = no_check
    problems: Callable[[TeacherEntry, RunFacts], list[str]] = no_problems
    report: Callable[[TeacherEntry, RunFacts], tuple[list[str], list[str]]] | None = None
    build: Callable[[TeacherEntry, Any, Any], Any] | None = None
