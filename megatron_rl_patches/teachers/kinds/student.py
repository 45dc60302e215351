"""The live self-teacher's kind: `student;context=KEY` — the student's current weights scoring each
sample's privileged context (under KEY) before its own response, through the host's own pass of
the student's model (`teachers.self_teacher`). The context is required: `student` alone would be
the student scoring itself. Standard library only at import."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches._variables import OPD_TEACHERS as TEACHERS
from megatron_rl_patches.teachers.kinds.entry import TeacherEntry
from megatron_rl_patches.teachers.kinds.kind import TeacherKind
from megatron_rl_patches.teachers.kinds.options import CONTEXT, context_option, split_entry

STUDENT = "student"
FORM = f"{STUDENT};{CONTEXT}KEY (the live self-teacher: the student's current weights, given a privileged context)"


def recognizes(entry: str) -> bool:
    return entry.partition(";")[0].strip() == STUDENT


def parse(entry: str) -> TeacherEntry:
    _, options = split_entry(entry)
    context, others = context_option(entry, options)
    if others:
        raise ValueError(f"{TEACHERS} entry {entry!r}: unknown option(s) {others}; the live self-teacher takes one "
                         f"option, ';{CONTEXT}KEY'")
    if context is None:
        raise ValueError(f"{TEACHERS} entry {entry!r}: the live self-teacher needs a privileged context, "
                         f"'{STUDENT};{CONTEXT}KEY' (without one it would be the student scoring itself: every "
                         "divergence zero); for a checkpoint directory named 'student' write its path, e.g. "
                         "./student")
    return TeacherEntry(STUDENT, kind=STUDENT, context=context)


def build(entry: TeacherEntry, host: Any, options: Any) -> Any:
    """The host's `SelfTeacher` (its `student_pass`)."""
    from megatron_rl_patches.teachers.self_teacher import self_teacher  # lazy: import cost: torch

    assert entry.context is not None  # parse requires it
    return self_teacher(host, options.top_k, options.temperature, entry.context,
                        f"build_teachers: entry '{STUDENT};{CONTEXT}{entry.context}'")


KIND = TeacherKind(STUDENT, FORM, recognizes=recognizes, parse=parse, build=build)
