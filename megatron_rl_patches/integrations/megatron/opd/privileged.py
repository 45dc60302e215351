"""In-process teachers of top-k OPD with a privileged context (`;context=KEY`): a snapshot (θ₀), a
separate model (a Hugging Face directory, `PATH@module:function`) or the live self-teacher
(`student;context=KEY`: the actor's current weights, through `StudentChunksPass`) scoring each sample's context
then the student's response. `PrivilegedTeacher` (the framework-free wrapper `teachers.Privileged`,
the one owner of a teacher's key) runs the wrapped teacher's passes over the rollout with each
sample's tokens replaced by context + response (`privileged_rollout`); the
response rows, the step's ids and the teacher's scores line up one to one with the student's. With
context parallelism (megatron-core's zigzag, or slime's `--allgather-cp`, whose per-sample fields
are kept in the zigzag rows too) a rank holds other rows of the response in the privileged
sequence than in the student's, whose length differs: the step's ids go to the rows of the
privileged sequence before the teacher's pass, and its scores come back to the student's rows
(`moved_rows`: one sum over the context-parallel group each way)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd.opd_teachers import ModelTeacher, OpdTeacher, ScoringStep
from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS, IDS, IDS_MASK
from megatron_rl_patches.integrations.megatron.opd.zigzag import whole_from_zigzag, zigzag_of_whole
from megatron_rl_patches.teachers.context.privileged import Privileged
from megatron_rl_patches.teachers.scores import TeacherScores


def privileged_rollout(rollout_data: dict, key: str) -> dict:
    """The rollout as a teacher with context `key` sees it: sample i's tokens its context (the
    step's checked ids, `CONTEXTS`) then its response; `total_lengths` theirs, every other field
    (response lengths, masks, the step's ids, micro-batches) the student's."""
    contexts = rollout_data.get(CONTEXTS)
    if contexts is None:  # the train_actor wrapper reads and agrees them before any teacher scores
        raise RuntimeError(f"slime_opd: a teacher with ';context={key}' scores a rollout without its contexts; "
                           "please report this")
    tokens = []
    for sample, (whole, response) in enumerate(zip(rollout_data["tokens"], rollout_data["response_lengths"])):
        context = contexts[sample][key].to(device=whole.device, dtype=whole.dtype)
        tokens.append(torch.cat([context, whole[len(whole) - int(response):]]))
    return {**rollout_data, "tokens": tokens, "total_lengths": [len(t) for t in tokens]}


def moved_rows(values: list[torch.Tensor], source: dict, target: dict,
               cut: Callable[[list[torch.Tensor], dict], list[torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """Per sample, values on this context-parallel rank's rows of the response in `source`'s
    sequences, on its rows of the same response in `target`'s (`cut`: the host's rows of whole
    responses, `ScoringStep.cut`; None: megatron-core's zigzag); every rank of the context-parallel
    group calls it together (one sum over it). Unchanged with one context-parallel rank."""
    whole = whole_from_zigzag(values, list(source["total_lengths"]), list(source["response_lengths"]))
    if cut is None:
        return zigzag_of_whole(whole, list(target["total_lengths"]), list(target["response_lengths"]))
    return cut(whole, target)


class PrivilegedTeacher(Privileged, OpdTeacher):
    """`teacher` (a `ModelTeacher`: of the student's tokenizer) scoring its context `context` before
    each response: the framework-free wrapper (`teachers.Privileged`, the one owner of its key),
    whose passes slime's OPD runs over `privileged_rollout`."""

    teacher: ModelTeacher

    def score(self, step: ScoringStep) -> TeacherScores | None:
        """The wrapped teacher's scores on the privileged sequences, on the student's rows (the ids
        it scores moved to the privileged sequences' rows, a first teacher's own ids moved back)."""
        own = step.rollout_data
        data = privileged_rollout(own, self.context)
        given = {key: moved_rows(own[key], own, data, step.cut) for key in (IDS, IDS_MASK) if key in own}
        data.update(given)
        seen = dataclasses.replace(step, rollout_data=data)
        out = self.teacher.score(seen)
        step.scored_ids = seen.scored_ids
        for key in (IDS, IDS_MASK):  # a first teacher's own top-k (or union) become the step's ids
            if key not in data:
                own.pop(key, None)
            elif data[key] is not given.get(key):
                own[key] = moved_rows(data[key], data, own, step.cut)
        if out is None:  # a stage before the last
            return None
        return dataclasses.replace(out, **{name: moved_rows(getattr(out, name), data, own, step.cut)
                                           for name in ("log_probs", "tails")})


class StudentChunksPass(ModelTeacher):
    """The live self-teacher's pass in slime, nothing else: a `ModelTeacher` whose chunks are the
    actor's own, with its current weights (before the rollout's first optimizer step, where slime
    computes its other per-rollout fields), no copy of them; its passes are the step's no-grad
    `forward_only` in the student's mode. What they compute is `teachers.SelfTeacher`'s: the fused
    top-k head (`topk_output_processor`) over the student's hidden states and output layer."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def model_chunks(self, actor: Any) -> list[Any]:
        return actor.student_chunks()
