"""The kinds of teacher, registered in one table as `FAMILIES` is for model families: `KINDS`
(one module each; `kind.py` says what a kind is), `kind_named(name)`, and the entry grammar of
MEGATRON_RL_PATCHES_OPD_TEACHERS read through it (`parse_entries`). Adding a kind is a module here,
a row below, and its builder beside the framework that loads it
(`integrations/megatron/teachers/teacher_builders.py`). Standard library only at import."""
from __future__ import annotations

from megatron_rl_patches._variables import OPD_TEACHERS as TEACHERS
from megatron_rl_patches.teachers.kinds import checkpoint, provider, served_entry, student
from megatron_rl_patches.teachers.kinds.entry import RunFacts, TeacherEntry
from megatron_rl_patches.teachers.kinds.kind import TeacherKind
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


def parse_entry(entry: str) -> TeacherEntry:
    """One entry (stripped) read by the first kind that recognizes it; a user or password in a URL
    refused first, whatever the kind."""
    refuse_userinfo(entry, f"{TEACHERS} entry")
    entry = entry.strip()
    return next(kind for kind in KINDS if kind.recognizes(entry)).parse(entry)


def parse_entries(raw: str) -> tuple[TeacherEntry, ...]:
    """Every comma-separated entry of the setting's value (empty pieces skipped); a user or
    password in a URL refused before the value is split (a password may hold ',')."""
    refuse_userinfo(raw, TEACHERS)
    return tuple(parse_entry(entry) for entry in raw.split(",") if entry.strip())


def check_entries(entries: tuple[TeacherEntry, ...], facts: RunFacts) -> None:
    """Each entry's kind checks it against the run (ValueError naming the entry)."""
    for entry in entries:
        kind_named(entry.kind).check(entry, facts)


def entry_problems(entries: tuple[TeacherEntry, ...], facts: RunFacts) -> list[str]:
    """What loading each entry would fail on, found by its kind without loading (`doctor`)."""
    return [problem for entry in entries for problem in kind_named(entry.kind).problems(entry, facts)]


def forms() -> str:
    """How entries are written, one kind per clause (errors, --help)."""
    return "; ".join(kind.form for kind in KINDS)


__all__ = ["KINDS", "REGISTRY", "TEACHERS", "RunFacts", "TeacherEntry", "TeacherKind", "check_entries",
           "entry_problems", "forms", "kind_named", "parse_entries", "parse_entry"]
