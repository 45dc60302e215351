"""The teachers' side of full-vocabulary OPD (MEGATRON_RL_PATCHES_OPD_K=vocab) for any Megatron
host: before the student's training step, each teacher hands over its final hidden states on the
response rows and its output layer at the student's tensor-parallel layout (`score_teachers`): a
snapshot of the actor or a separate model of the student's vocabulary in a pipelined pass over the
rollout (the hidden states gathered under sequence parallelism, its output weight's shard kept
once), a served teacher with `;head=DIR` from its pooling server (the head read by
`served_teacher`'s builder). A teacher with a privileged context (`;context=KEY`) gives its
states from its pass over each sample's context + response, on the student's response rows (an
in-process one's pass over `privileged.privileged_rollout`, its rows moved to the student's; a
served one sends its contexts itself). They reach the training step as per-sample fields in the
context-parallel zigzag rows (`topk_request.TEACHER_HIDDEN`, `TEACHER_HEADS`: `TeacherHeads`); the
host's step computes the divergence (slime: `integrations.slime.vocab_opd`)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd.opd_teachers import ModelTeacher, OpdTeacher
from megatron_rl_patches.integrations.megatron.opd.privileged import (
    PrivilegedTeacher,
    moved_rows,
    privileged_rollout,
)
from megatron_rl_patches.integrations.megatron.opd.served_opd import ServedOpdTeacher
from megatron_rl_patches.integrations.megatron.opd.stage_host import device_of
from megatron_rl_patches.integrations.megatron.opd.topk_request import (
    TEACHER_HEADS,
    TEACHER_HIDDEN,
    TopkRequest,
    VocabRequest,
)
from megatron_rl_patches.integrations.megatron.opd.zigzag import zigzag_of_whole
from megatron_rl_patches.model.chunks import unwrap
from megatron_rl_patches.teachers.head.padding import head_padded_as


@dataclass(frozen=True, eq=False)  # tensors inside: compared by identity
class TeacherHeads:
    """The teachers' output weights [V_local, H_j] (the student's vocabulary shard), in the order
    of MEGATRON_RL_PATCHES_OPD_TEACHERS, and the real vocabulary the divergence runs over (None:
    the student's whole padded one, as slime's log-probs)."""

    weights: tuple[torch.Tensor, ...]
    vocab_size: int | None = None


def real_vocab_size(model: Any) -> int | None:
    """The unpadded vocab a chunk (or a wrapper of it) built by build_inference_model_from_hf
    carries as `hf_vocab_size`; None for other models (slime scores their padded columns)."""
    while model is not None:
        size = getattr(model, "__dict__", {}).get("hf_vocab_size")
        if size is not None:
            return int(size)
        model = getattr(model, "module", None)
    return None


# (args, model chunks, rollout data, request) -> per-sample fields: opd's `topk_pass` (agreed over the pipeline)
Pass = Callable[[Any, list, dict, TopkRequest], dict]


def score_teachers(actor: Any, rollout_data: dict, teachers: list[OpdTeacher], last: bool, passes: Pass) -> None:
    """Every teacher's hidden states and head, in teacher order on every pipeline stage (each
    model teacher's pipelined pass by `passes`; each served teacher's reply collected, its failure
    agreed over the job); stored into the rollout data on the last stage (`last`)."""
    states, weights, vocabs = [], [], []
    for teacher in teachers:
        if isinstance(teacher, (PrivilegedTeacher, ModelTeacher)):
            if isinstance(teacher, PrivilegedTeacher):  # its states from context + response, its model's vocabulary
                hidden, weight = privileged_hidden(actor, rollout_data, teacher, passes)
                model: ModelTeacher = teacher.teacher
            else:
                hidden, weight = model_hidden(actor, rollout_data, teacher, passes)
                model = teacher
            if not isinstance(model, str):  # a separate model (a snapshot is the actor's architecture)
                vocabs.append(real_vocab_size(model.model_chunks(actor)[-1]))  # a Hugging Face one's real ids
        elif isinstance(teacher, ServedOpdTeacher):
            hidden, weight = served_hidden(rollout_data, teacher)
            if teacher.teacher is not None and teacher.teacher.head is not None:
                vocabs.append(teacher.teacher.head.vocab_size)  # its zero padding rows get no mass
        else:  # the settings refuse it (opd_settings.full_vocab_refusal)
            raise RuntimeError(f"slime_opd: {teacher!r} gives no hidden states for MEGATRON_RL_PATCHES_OPD_K=vocab; "
                               "please report this")
        states.append(hidden)
        weights.append(weight)
    if not last:
        return
    rollout_data[TEACHER_HIDDEN] = [tuple(sample) for sample in zip(*states)]
    real = [size for size in vocabs if size is not None]
    heads = TeacherHeads(tuple(weights), min(real) if real else None)
    rollout_data[TEACHER_HEADS] = [heads] * len(rollout_data[TEACHER_HIDDEN])


def model_hidden(actor: Any, rollout_data: dict, teacher: ModelTeacher, passes: Pass) -> tuple[Any, Any]:
    """A model teacher's per-sample hidden states and its output weight's shard (None, None on a
    stage before the last)."""
    request = VocabRequest(hidden=True)
    out = passes(actor.args, teacher.model_chunks(actor), rollout_data, request)
    if "teacher_hidden" not in out:
        return None, None
    return out["teacher_hidden"], request.captured[0]


def privileged_hidden(actor: Any, rollout_data: dict, teacher: PrivilegedTeacher,
                      passes: Pass) -> tuple[Any, Any]:
    """An in-process teacher's hidden states from its pass over each sample's context + response,
    on this context-parallel rank's rows of the student's responses, and its output weight's
    shard (None, None on a stage before the last)."""
    seen = privileged_rollout(rollout_data, teacher.context)
    hidden, weight = model_hidden(actor, seen, teacher.teacher, passes)
    if hidden is None:
        return None, None
    return moved_rows(hidden, seen, rollout_data), weight


def served_hidden(rollout_data: dict, teacher: ServedOpdTeacher) -> tuple[Any, Any]:
    """A served teacher's hidden states (its pooling server's reply, unprojected) in this
    context-parallel rank's zigzag rows and its head's shard (None, None off the last stage)."""
    states = teacher.collected(projected=False)
    if states is None or teacher.teacher is None or teacher.teacher.head is None:
        return None, None
    assert isinstance(states, list)  # unprojected: the hidden states
    head = teacher.teacher.head
    totals = [int(t) for t in rollout_data["total_lengths"]]
    responses = [int(r) for r in rollout_data["response_lengths"]]
    device = device_of(rollout_data)
    whole = [s.reshape(-1, head.hidden_size).to(device=device, dtype=head.dtype) for s in states]
    return zigzag_of_whole(whole, totals, responses), head.weight


def check_loaded(actor: Any, teachers: list[OpdTeacher]) -> None:
    """ValueError naming the teacher whose output layer is not the student's vocabulary shard
    (checked at load, the same on every rank: the padded vocabulary sizes are the models'); a
    served teacher's head re-cut to the student's padded vocabulary where it was read at another
    (every rank of the last stage's tensor-parallel group holds one: `head_padded_as`)."""
    student = _padded_vocab(actor.model[-1])
    for index, teacher in enumerate(teachers):
        if isinstance(teacher, PrivilegedTeacher):  # its model's output layer
            teacher = teacher.teacher
        if isinstance(teacher, ServedOpdTeacher) and teacher.teacher is not None \
                and teacher.teacher.head is not None:
            teacher.teacher.head = head_padded_as(teacher.teacher.head, student)
        if isinstance(teacher, ModelTeacher) and not isinstance(teacher, str):
            own = _padded_vocab(teacher.model_chunks(actor)[-1])
            if own != student:
                raise ValueError(f"MEGATRON_RL_PATCHES_OPD_K=vocab: teacher {index} (MEGATRON_RL_PATCHES_OPD_TEACHERS) "
                                 f"has a padded vocabulary of {own}, the student {student}: the full-vocabulary "
                                 "divergence compares their output layers row by row; pad both alike "
                                 "(--make-vocab-size-divisible-by) or use a top-k MEGATRON_RL_PATCHES_OPD_K=N")


def _padded_vocab(chunk: Any) -> int:
    return int(unwrap(chunk).vocab_size)
