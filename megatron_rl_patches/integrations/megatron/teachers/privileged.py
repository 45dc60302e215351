"""In-process teachers of top-k OPD with a privileged context (`;context=KEY`): a snapshot (θ₀), a
separate model (a Hugging Face directory, `PATH@module:function`) or the live self-teacher
(`student;context=KEY`: the actor's current weights, `LiveTeacher`) scoring each sample's context
then the student's response. `PrivilegedTeacher` runs the wrapped teacher's passes over the
rollout with each sample's tokens replaced by context + response (`privileged_rollout`); the
response rows, the step's ids and the teacher's scores line up one to one with the student's (at
context parallelism 1: the rows of a sample are its response's, wherever the response starts)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.teachers.opd_teachers import ModelTeacher, OpdTeacher, ScoringStep
from megatron_rl_patches.integrations.megatron.teachers.topk_request import CONTEXTS, IDS, IDS_MASK
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


class PrivilegedTeacher(OpdTeacher):
    """`teacher` (a teacher of the student's tokenizer) scoring its context `key` before each response."""

    def __init__(self, teacher: ModelTeacher, key: str) -> None:
        self.teacher, self.key = teacher, key

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.teacher!r}, context={self.key!r})"

    def score(self, step: ScoringStep) -> TeacherScores | None:
        seen = dataclasses.replace(step, rollout_data=privileged_rollout(step.rollout_data, self.key))
        out = self.teacher.score(seen)
        step.scored_ids = seen.scored_ids
        for key in (IDS, IDS_MASK):  # a first teacher's own top-k (or union) become the step's ids
            if key in seen.rollout_data:
                step.rollout_data[key] = seen.rollout_data[key]
            else:
                step.rollout_data.pop(key, None)
        return out


class LiveTeacher(ModelTeacher):
    """The live self-teacher: the actor's own current weights (before the rollout's first optimizer
    step, where slime computes its other per-rollout fields), no copy of them; its passes are the
    step's no-grad `forward_only`, in the student's mode."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def model_chunks(self, actor: Any) -> list[Any]:
        return actor.student_chunks()
