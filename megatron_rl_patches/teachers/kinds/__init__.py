"""The kinds of teacher, registered in one table as `FAMILIES` is for model families: `KINDS`
(one module each; `kind.py` says what a kind is), `kind_named(name)`, and the entry grammar of
MEGATRON_RL_PATCHES_OPD_TEACHERS read through it (`parse_entries`; any other setting's through
`parse_entry` / `parse_variable`, its own name passed in: the one parser of entries). Adding a kind is a module here,
a row below, and its builder beside the framework that loads it
(`integrations/megatron/opd/teacher_builders.py`). Standard library only at import."""
from __future__ import annotations

from collections.abc import Sequence

from megatron_rl_patches.settings import OPD_TEACHERS as TEACHERS
from megatron_rl_patches.teachers.entry import RunFacts, TeacherEntry
from megatron_rl_patches.teachers.kinds import checkpoint, provider, served_entry, student
from megatron_rl_patches.teachers.kinds.kind import TeacherKind
from megatron_rl_patches.teachers.kinds.options import entry_named, variable_named
from megatron_rl_patches.teachers.redaction import refuse_userinfo

# The first row that recognizes an entry parses it: a URL before anything splits it, the live
# self-teacher's word `student`, a provider's '@' before a path, a path last (it takes every other entry).
KINDS: tuple[TeacherKind, ...] = (served_entry.KIND, student.KIND, provider.KIND, checkpoint.KIND)
REGISTRY: dict[str, TeacherKind] = {kind.name: kind for kind in KINDS}


def kind_named(name: str) -> TeacherKind:
    """The row of a `TeacherEntry.kind`."""
    kind = REGISTRY.get(name)
    if kind is None:
        raise ValueError(f"no teacher kind {name!r}: the kinds are {sorted(REGISTRY)}")
    return kind


def read_entry(entry: str, said: str | None = None, kinds: Sequence[TeacherKind] = KINDS) -> TeacherEntry:
    """One entry (stripped) read by the first of `kinds` that recognizes it, every message naming it
    as `said` (default: an entry of MEGATRON_RL_PATCHES_OPD_TEACHERS). Its URLs' user or password
    was refused where the text came in (`parse_entry`, `parse_entries`, `parse_variable`,
    `build_teachers`): nothing here scans for one again."""
    entry = entry.strip()
    said = entry_named(entry) if said is None else said
    kind = next((kind for kind in kinds if kind.recognizes(entry)), None)
    if kind is None:
        raise ValueError(f"{said}: expected {' or '.join(kind.form for kind in kinds)}")
    return kind.parse(entry, said)


def parse_entry(entry: str, setting: str = TEACHERS) -> TeacherEntry:
    """One entry of `setting` (the variable or argument it came in, which every message names), a
    user or password in a URL refused first (the one check), whatever the kind."""
    refuse_userinfo(entry, f"{setting} entry")
    return read_entry(entry, entry_named(entry.strip(), setting))


def parse_entries(raw: str, setting: str = TEACHERS) -> tuple[TeacherEntry, ...]:
    """Every comma-separated entry of `setting`'s value (empty pieces skipped); a user or password in
    a URL refused once, before the value is split (a password may hold ',')."""
    refuse_userinfo(raw, setting)
    return tuple(read_entry(entry, entry_named(entry.strip(), setting)) for entry in raw.split(",") if entry.strip())


def parse_variable(raw: str, variable: str, kinds: Sequence[TeacherKind] = KINDS) -> TeacherEntry:
    """The one entry a variable holds (verl's MEGATRON_RL_PATCHES_VERL_TEACHER), read by `kinds`: a
    user or password in a URL refused on the raw value first (the one check), every message naming
    the variable as the user set it (`VARIABLE='value'`)."""
    refuse_userinfo(raw, variable)
    return read_entry(raw, variable_named(raw, variable), kinds)


def check_entries(entries: tuple[TeacherEntry, ...], facts: RunFacts) -> None:
    """Each entry's kind checks it against the run (ValueError naming the entry)."""
    for entry in entries:
        kind_named(entry.kind).check(entry, facts)


def entry_problems(entries: tuple[TeacherEntry, ...], facts: RunFacts) -> list[str]:
    """What loading each entry would fail on, found by its kind without loading (`doctor`)."""
    return [problem for entry in entries for problem in kind_named(entry.kind).problems(entry, facts)]


def entry_report(entries: tuple[TeacherEntry, ...], facts: RunFacts) -> tuple[list[str], list[str]]:
    """`entry_problems` and, beside them, what each entry's kind checked that held (`doctor`: a
    served teacher's server, its route)."""
    problems: list[str] = []
    checked: list[str] = []
    for entry in entries:
        kind = kind_named(entry.kind)
        found, held = kind.report(entry, facts) if kind.report is not None else (kind.problems(entry, facts), [])
        problems += found
        checked += held
    return problems, checked


def forms() -> str:
    """How entries are written, one kind per clause (errors, --help)."""
    return "; ".join(kind.form for kind in KINDS)


__all__ = ["KINDS", "REGISTRY", "TEACHERS", "RunFacts", "TeacherEntry", "TeacherKind", "check_entries",
           "entry_problems", "entry_report", "forms", "kind_named", "parse_entries", "parse_entry", "parse_variable",
           "read_entry"]
