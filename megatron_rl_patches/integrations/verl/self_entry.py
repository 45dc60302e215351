"""MEGATRON_RL_PATCHES_VERL_TEACHER's live self-teacher entry, `student;context=KEY[;tokenizer=DIR]`:
its read (`self_entry`, through the variable's one parser, `entry.parse_entry`) and what verl's
agent loop stores in its place (`placeholder_rows`); the trainer's side is `self_teacher`."""
from __future__ import annotations

import os

import torch

from megatron_rl_patches._variables import VERL_TEACHER
from megatron_rl_patches.integrations.verl.entry import parse_entry
from megatron_rl_patches.teachers.kinds import student

WHO = f"verl's live self-teacher ({VERL_TEACHER}='student;context=KEY')"


def self_entry() -> tuple[str, str | None] | None:
    """(KEY, tokenizer DIR or None) when the variable names the live self-teacher, else None (a
    served entry is read where verl's agent loop asks it); a bad entry refused naming the variable
    (every rank reads the same variable: the same error)."""
    raw = os.environ.get(VERL_TEACHER, "").strip()
    if not raw or not student.recognizes(raw):
        return None
    entry = parse_entry(raw)
    assert entry.context is not None  # the kind requires it
    return entry.context, entry.tokenizer


def placeholder_rows(sequence_ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What verl's agent loop stores for the live self-teacher: zeros in verl's teacher-row layout
    ([L, max(k, 1)] int32 ids and float32 log-probs), replaced on the trainer (nothing is asked)."""
    shape = (len(list(sequence_ids)), max(int(k), 1))
    return torch.zeros(shape, dtype=torch.int32), torch.zeros(shape)
