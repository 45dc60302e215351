"""MEGATRON_RL_PATCHES_VERL_TEACHER's live self-teacher entry, `student;context=KEY[;tokenizer=DIR]`:
its read (`self_entry`) and what verl's agent loop stores in its place (`placeholder_rows`); the
trainer's side is `self_teacher`."""
from __future__ import annotations

import os

import torch

from megatron_rl_patches._variables import OPD_TEACHERS, VERL_TEACHER
from megatron_rl_patches.teachers.kinds import student

WHO = f"verl's live self-teacher ({VERL_TEACHER}='student;context=KEY')"
FORM = "student;context=KEY[;tokenizer=DIR]"


def self_entry() -> tuple[str, str | None] | None:
    """(KEY, tokenizer DIR or None) when the variable names the live self-teacher, else None; a bad
    entry refused naming the variable (every rank reads the same variable: the same error)."""
    raw = os.environ.get(VERL_TEACHER, "").strip()
    if not raw or not student.recognizes(raw):
        return None
    options = [part.strip() for part in raw.split(";")[1:]]
    tokenizer = next((o.partition("=")[2].strip() for o in options if o.partition("=")[0].strip() == "tokenizer"),
                     None)
    rest = ";".join([student.STUDENT] + [o for o in options if o.partition("=")[0].strip() != "tokenizer"])
    try:
        key = student.parse(rest).context
    except ValueError as error:
        said = str(error).replace(f"{OPD_TEACHERS} entry ", "entry ")  # the slime variable's name: not verl's
        raise ValueError(f"{VERL_TEACHER}={raw!r}: {said}; the form is {FORM}") from None
    assert key is not None  # parse requires it
    if tokenizer == "":
        raise ValueError(f"{VERL_TEACHER}={raw!r}: tokenizer= needs the teacher's tokenizer directory (the student's: "
                         f"text contexts are tokenized by it); the form is {FORM}")
    return key, tokenizer


def placeholder_rows(sequence_ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What verl's agent loop stores for the live self-teacher: zeros in verl's teacher-row layout
    ([L, max(k, 1)] int32 ids and float32 log-probs), replaced on the trainer (nothing is asked)."""
    shape = (len(list(sequence_ids)), max(int(k), 1))
    return torch.zeros(shape, dtype=torch.int32), torch.zeros(shape)
