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


def not_hosted(framework: str, where: str) -> ValueError:
    """The refusal of `student[;context=KEY]` where `framework`'s route has no pass of the student's
    current weights to run it in, naming the routes that take it."""
    return ValueError(f"{where}: the live self-teacher ('{STUDENT};{CONTEXT}KEY': the student's current weights "
                      f"scoring its privileged sequences) is not hosted in {framework}: it runs in slime "
                      f"({TEACHERS}='{STUDENT};{CONTEXT}KEY', the slime_opd patch), in NeMo-RL "
                      "(integrations.nemo_rl.self_teacher_policy(context=KEY)) and in the public teacher step "
                      f"(teachers.build_teachers('{STUDENT};{CONTEXT}KEY', LoopHost(..., student_pass=fn)) or "
                      f"teachers.SelfTeacher: any loop, one rank or tensor parallel); in {framework}, serve a copy of "
                      f"the student (vLLM) and give its URL ';{CONTEXT}KEY' (a frozen teacher, not the live weights)")


def build(entry: TeacherEntry, host: Any, options: Any) -> Any:
    """The host's `SelfTeacher` (its `student_pass`)."""
    from megatron_rl_patches.teachers.self_teacher import self_teacher  # lazy: import cost: torch

    assert entry.context is not None  # parse requires it
    return self_teacher(host, options.top_k, options.temperature, entry.context,
                        f"build_teachers: entry '{STUDENT};{CONTEXT}{entry.context}'")


KIND = TeacherKind(STUDENT, FORM, recognizes=recognizes, parse=parse, build=build)
