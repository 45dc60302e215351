"""MEGATRON_RL_PATCHES_VERL_TEACHER read by the teachers' grammar (`teachers.kinds`, the one parser of
entries, the variable's own name in every message): a served teacher
(`http(s)://host:port[|...];engine=vllm[;head=DIR][;context=KEY[;tokenizer=DIR]]`) or the live
self-teacher (`student;context=KEY[;tokenizer=DIR]`, its tokenizer the student's); a user or
password in a URL refused on the raw value before anything splits it. What the served kind writes
and verl does not serve (another tokenizer's buckets, a server without a tokenizer) is refused by
name: verl's `;tokenizer=DIR` reads text contexts only.

The variable is read and parsed once at each of verl's doors that asks (its teacher client, its
agent-loop worker, its engine: `verl_teacher(owner)`, held by that object) into a `VerlTeacher`
passed down: nothing below a door reads it again, and which route serves is the entry's fields
(`head`, `context`, its kind), never the text's substrings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rl_patches import settings
from megatron_rl_patches.integrations.verl.held import held
from megatron_rl_patches.settings import VERL_TEACHER
from megatron_rl_patches.teachers.entry import SERVED, STUDENT, TeacherEntry
from megatron_rl_patches.teachers.kinds import parse_variable, served_entry, student
from megatron_rl_patches.teachers.kinds.options import variable_named

FORM = "http(s)://host:port[|http(s)://host:port...];engine=vllm[;head=DIR][;context=KEY[;tokenizer=DIR]]"
# the rows of the kinds table verl's variable takes: a served teacher, the live self-teacher naming its tokenizer
KINDS = (served_entry.KIND, student.NAMING_TOKENIZER)


@dataclass(frozen=True)
class VerlTeacher:
    """MEGATRON_RL_PATCHES_VERL_TEACHER as one of verl's doors read it: the text as written, trimmed
    (`raw`, "" when unset; the served teachers' cache key and what a message shows, redacted) and its
    entry (None when unset)."""

    raw: str = ""
    entry: TeacherEntry | None = None

    @property
    def served(self) -> TeacherEntry | None:
        """The entry when it names a served teacher (verl's teacher client asks it), else None."""
        return self.entry if self.entry is not None and self.entry.kind == SERVED else None

    @property
    def head(self) -> TeacherEntry | None:
        """The served entry when it names a head (`;head=DIR`: the whole-vocabulary route on the
        trainer), else None."""
        served = self.served
        return served if served is not None and served.head is not None else None

    @property
    def self_teacher(self) -> tuple[str, str | None] | None:
        """(KEY, tokenizer DIR or None) when the entry is the live self-teacher (`student;context=KEY`,
        scored on verl's trainer), else None."""
        if self.entry is None or self.entry.kind != STUDENT:
            return None
        assert self.entry.context is not None  # the kind requires it
        return self.entry.context, self.entry.tokenizer


def read_teacher(raw: str) -> VerlTeacher:
    """The variable's text `raw` read (`parse_entry`; "" or blank: unset)."""
    raw = raw.strip()
    return VerlTeacher(raw, parse_entry(raw) if raw else None)


def verl_teacher(owner: Any) -> VerlTeacher:
    """The variable as `owner` (the verl object at whose door it is read: its teacher client, its
    agent-loop worker, its engine) reads it: parsed at its first call and held by it (`held`), so a
    step reads it once and passes it down; a bad entry refused naming the variable, at every call. No
    owner (a wrapped function called unbound): read for that call."""
    if owner is None:
        return read_teacher(settings.verl_teacher())
    return held(owner, "verl_teacher", lambda: read_teacher(settings.verl_teacher()))


def parse_entry(raw: str) -> TeacherEntry:
    """The variable's value read (`teachers.kinds.parse_variable`); what verl cannot serve of a
    served entry refused naming the variable."""
    entry = parse_variable(raw, VERL_TEACHER, KINDS)
    if entry.kind == SERVED:
        check_verl_options(entry, variable_named(raw, VERL_TEACHER))
    return entry


def check_verl_options(entry: TeacherEntry, said: str) -> None:
    """A served entry as verl serves it: the teacher's rows are the student's ids (no other
    tokenizer's buckets, no `;same_tokenizer` probe), `;tokenizer=DIR` reads text contexts."""
    given = (("stop_tokens=", entry.stop_tokens), ("same_tokenizer", entry.same_tokenizer), ("vocab=", entry.vocab),
             ("config=", entry.config))
    unserved = [written for written, value in given if value]
    if unserved:
        raise ValueError(f"{said}: option(s) {unserved} are slime's (MEGATRON_RL_PATCHES_OPD_TEACHERS); verl's "
                         "served teacher scores the student's ids, its tokenizer probed at the server: drop them; the "
                         f"form is {FORM}")
    if entry.tokenizer is not None and entry.context is None:
        raise ValueError(f"{said}: tokenizer= reads text contexts and there is no context=KEY; drop it or add the "
                         f"context's field; the form is {FORM}")
