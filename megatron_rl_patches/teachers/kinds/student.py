"""The live self-teacher's kind: `student;context=KEY` — the student's current weights scoring each
sample's privileged context (under KEY) before its own response, through the host's own pass of
the student's model (`teachers.self_teacher`). The context is required: `student` alone would be
the student scoring itself. Where the host cannot read the student's tokenizer itself (verl's
trainer), its variable's row (`NAMING_TOKENIZER`) also takes `;tokenizer=DIR`: the student's
tokenizer, which reads text contexts. Standard library only at import."""
from __future__ import annotations

import functools
from typing import Any

from megatron_rl_patches.teachers.entry import STUDENT, TeacherEntry
from megatron_rl_patches.teachers.kinds.kind import TeacherKind
from megatron_rl_patches.teachers.kinds.options import CONTEXT, context_option, split_entry
from megatron_rl_patches.teachers.redaction import quoted

TOKENIZER = "tokenizer="
FORM = f"{STUDENT};{CONTEXT}KEY (the live self-teacher: the student's current weights, given a privileged context)"
NAMING_FORM = f"{STUDENT};{CONTEXT}KEY[;{TOKENIZER}DIR]"


def recognizes(entry: str) -> bool:
    return entry.partition(";")[0].strip() == STUDENT


def parse(entry: str, said: str, named_tokenizer: bool = False) -> TeacherEntry:
    """The entry's record; with `named_tokenizer` (`NAMING_TOKENIZER`) its `;tokenizer=DIR` too."""
    _, options = split_entry(entry, said)
    context, others = context_option(said, options)
    tokenizer = None
    form = f"; the form is {NAMING_FORM}" if named_tokenizer else ""
    if named_tokenizer:
        named = [option for option in others if option.partition("=")[0].strip() == TOKENIZER[:-1]]
        others = [option for option in others if option not in named]
        tokenizer = named[0].partition("=")[2].strip() if named else None
        if tokenizer == "":
            raise ValueError(f"{said}: {TOKENIZER} needs the teacher's tokenizer directory (the student's: text "
                             f"contexts are tokenized by it){form}")
    if others:
        takes = (f"';{CONTEXT}KEY' and ';{TOKENIZER}DIR' (the student's tokenizer, for text contexts)"
                 if named_tokenizer else f"one option, ';{CONTEXT}KEY'")
        unknown = ", ".join(quoted(option) for option in others)
        raise ValueError(f"{said}: unknown option(s) [{unknown}]; the live self-teacher takes {takes}{form}")
    if context is None:
        raise ValueError(f"{said}: the live self-teacher needs a privileged context, '{STUDENT};{CONTEXT}KEY' "
                         "(without one it would be the student scoring itself: every divergence zero); for a "
                         f"checkpoint directory named 'student' write its path, e.g. ./student{form}")
    return TeacherEntry(STUDENT, kind=STUDENT, context=context, tokenizer=tokenizer)


def build(entry: TeacherEntry, host: Any, options: Any) -> Any:
    """The host's `SelfTeacher` (its `student_pass`)."""
    from megatron_rl_patches.teachers.self_teacher import self_teacher  # lazy: import cost: torch

    assert entry.context is not None  # parse requires it
    where = f"build_teachers: entry '{STUDENT};{CONTEXT}{entry.context}'"
    return self_teacher(host, options.plan, entry.context, where)


KIND = TeacherKind(STUDENT, FORM, recognizes=recognizes, parse=parse, build=build)
# a variable whose host cannot read the student's tokenizer (verl's): `;tokenizer=DIR` names it
NAMING_TOKENIZER = TeacherKind(STUDENT, NAMING_FORM, recognizes=recognizes,
                               parse=functools.partial(parse, named_tokenizer=True), build=build)
