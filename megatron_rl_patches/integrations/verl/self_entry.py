"""MEGATRON_RL_PATCHES_VERL_TEACHER's live self-teacher entry, `student;context=KEY[;tokenizer=DIR]`
(read at verl's doors: `entry.verl_teacher`, `VerlTeacher.self_teacher`): what verl's agent loop
stores in its place (`placeholder_rows`); the trainer's side is `self_teacher`."""
from __future__ import annotations

import torch

from megatron_rl_patches.settings import VERL_TEACHER

WHO = f"verl's live self-teacher ({VERL_TEACHER}='student;context=KEY')"


def placeholder_rows(sequence_ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What verl's agent loop stores for the live self-teacher: zeros in verl's teacher-row layout
    ([L, max(k, 1)] int32 ids and float32 log-probs), replaced on the trainer (nothing is asked)."""
    shape = (len(list(sequence_ids)), max(int(k), 1))
    return torch.zeros(shape, dtype=torch.int32), torch.zeros(shape)
