"""A teacher step's heads checked when the step is built (`step_heads_failure`): every rank of the
sharing group projects the states one rank asked for through its own head, so the ranks must hold
the same checkpoint's head (`head_fingerprint.compare_heads`: its config and a few rows of its
output layer, its width, vocabulary, padding and dtype), and a head's vocabulary must lie within
the student's (a larger one gives top-k ids the student cannot score). The comparison is one
object all-gather over the sharing group when the step is built (every rank of it builds the step;
never over the job group, part of which may hold no step: a pipelined actor's other stages);
its failure is kept and raised at the step's first `collect`, agreed over the job there (ranks of
other sharing groups learn it too). Without a group it is raised at once."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_rl_patches.teachers.agreement import distributed
from megatron_rl_patches.teachers.asynchronous import AsyncTeacher


def step_heads_failure(teachers: Sequence[Any], host: Any) -> Exception | None:
    """The step's head failure on this rank (None: the heads agree), every rank of the host's
    sharing group calling it alike (none: this rank's own check only); raised here without
    torch.distributed or any group."""
    heads = [teacher.head if isinstance(teacher, AsyncTeacher) else None for teacher in teachers]
    local = None
    for i, head in enumerate(heads):
        if head is not None and head.vocab_size > int(host.vocab_size):
            local = ValueError(f"TeacherStep: teacher {i}'s head ({head.source or 'built by hand'}) has a vocabulary "
                               f"of {head.vocab_size}, larger than the student's {host.vocab_size} (host.vocab_size): "
                               "its top-k would hold ids the student cannot score; serve a teacher of the student's "
                               "vocabulary")
            break
    if not distributed() or host.share_group is None and host.job_group is None:
        if local is not None:
            raise local
        return None
    if host.share_group is None:  # each rank asks for its own states: only its own head's vocabulary to check
        return local  # (the job group is not compared here: a pipelined actor builds the step on one stage only)
    from megatron_rl_patches.teachers.head.fingerprint import compare_heads, head_facts  # lazy: import cost

    try:
        compare_heads(host.share_group, "TeacherStep", [None if head is None else head_facts(head) for head in heads],
                      local, where="the sharing group")
    except Exception as failed:  # noqa: BLE001 - raised at the first collect, agreed over the job there
        return failed
    return None
