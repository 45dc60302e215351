"""A served teacher's head on a student's rank (`student_layout_head`): the teacher's output layer
read once per process at the student's vocabulary layout, for the whole-vocabulary divergence a
framework's student step computes (NeMo-RL's `vocab_kd`, verl's `vocab`)."""
from __future__ import annotations

import threading
from typing import Any

import torch

from megatron_rl_patches.teachers.head.teacher_head import TeacherHead

_HEADS: dict[tuple[str, int, int, torch.dtype], TeacherHead] = {}  # (dir, group id, rows, dtype) -> shard
_LOCK = threading.Lock()


def student_layout_head(path: str, weight: torch.Tensor, tp_group: Any, who: str) -> TeacherHead:
    """The teacher head of the Hugging Face directory `path` at the layout of the student's output
    weight shard `weight` [V_local, H_s]: padded to V_local × TP rows and cut as the student's is,
    in the student's dtype; read once per directory, group and layout. `who` names the caller in
    the refusal of a vocabulary the student's does not hold."""
    rows = int(weight.shape[0])
    key = (str(path), id(tp_group), rows, weight.dtype)
    with _LOCK:
        head = _HEADS.get(key)
        if head is None:
            head = _HEADS[key] = TeacherHead.from_hf(path, tp_group=tp_group, dtype=weight.dtype,
                                                     make_vocab_size_divisible_by=rows)
    if head.weight.shape[0] != rows:
        raise ValueError(f"{who}: the teacher head of {path} holds {head.weight.shape[0]} vocabulary rows on this "
                         f"rank but the student's output layer {rows}: the teacher's vocabulary ({head.vocab_size}) "
                         f"must fit the student's")
    return head
