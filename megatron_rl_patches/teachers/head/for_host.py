"""A `;head=DIR` entry's head at the host's student layout (`head_for_host`): built by
`build_teachers` for a host, the head is cut over the host's tensor-parallel group and padded to its
student's vocabulary rows, so it meets the student's output-layer shard row by row in
`divergence_output_processor` / `lm_head_divergence`; a host without a layout (`local_host`) gets
the whole head, unpadded."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.teachers.head.teacher_head import TeacherHead, group_position


def head_for_host(directory: str, host: Any, where: str) -> TeacherHead:
    """`TeacherHead.from_hf(directory)` over `host.tp_group`, padded to `host.padded_vocab_size`
    (each rank of the group calls it); ValueError naming `where` when the teacher's vocabulary does
    not fit the student's padded one."""
    group = getattr(host, "tp_group", None)
    padded = getattr(host, "padded_vocab_size", None)
    _, size = group_position(group)
    if padded is not None and padded % size:
        raise ValueError(f"{where}: the host's padded vocabulary ({padded} rows) does not split over its "
                         f"{size} tensor-parallel ranks")
    head = TeacherHead.from_hf(directory, tp_group=group,
                               make_vocab_size_divisible_by=None if padded is None else padded // size)
    if padded is not None and head.padded_vocab_size != padded:
        raise ValueError(f"{where}: the teacher head of {directory} has {head.vocab_size} vocabulary rows, more "
                         f"than the student's padded vocabulary of {padded}: the full-vocabulary divergence compares "
                         "their output layers row by row")
    return head
