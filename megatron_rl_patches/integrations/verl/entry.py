"""MEGATRON_RL_PATCHES_VERL_TEACHER read by the teachers' grammar (`teachers.kinds`, the one parser of
entries, the variable's own name in every message): a served teacher
(`http(s)://host:port[|...];engine=vllm[;head=DIR][;context=KEY[;tokenizer=DIR]]`) or the live
self-teacher (`student;context=KEY[;tokenizer=DIR]`, its tokenizer the student's); a user or
password in a URL refused on the raw value before anything splits it. What the served kind writes
and verl does not serve (another tokenizer's buckets, a server without a tokenizer) is refused by
name: verl's `;tokenizer=DIR` reads text contexts only."""
from __future__ import annotations

from megatron_rl_patches._variables import VERL_TEACHER
from megatron_rl_patches.teachers.entry import SERVED, TeacherEntry
from megatron_rl_patches.teachers.kinds import parse_variable, served_entry, student
from megatron_rl_patches.teachers.kinds.options import variable_named

FORM = "http(s)://host:port[|http(s)://host:port...];engine=vllm[;head=DIR][;context=KEY[;tokenizer=DIR]]"
# the rows of the kinds table verl's variable takes: a served teacher, the live self-teacher naming its tokenizer
KINDS = (served_entry.KIND, student.NAMING_TOKENIZER)


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
