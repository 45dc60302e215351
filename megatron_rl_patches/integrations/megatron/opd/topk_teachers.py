"""The teachers' side of top-k OPD for any Megatron host (`score_teachers`, the counterpart of
`hidden_teachers.score_teachers` for the full vocabulary): the student's own top-k pass selects
the ids (first, never skipped), each teacher scores them (`OpdTeacher.score`, in teacher order on
every pipeline stage), and on the last stage `store_scores` puts what they return in the rollout
data's per-sample fields (`topk_request`'s keys) by what the scores carry: those over the step's
ids stacked per sample as [n, R, k] / [n, R], grouped buckets (a teacher with another tokenizer)
with the step's ids and their own (`place`), cut to this context-parallel rank's rows as the host
keeps per-sample fields (`ScoringStep.cut`). `score_step` runs a step's teachers either way (top-k
or the full vocabulary's hidden states). The host supplies its actor (`TeacherActor`), its pass over
the rollout and its cut (slime: `integrations.slime.opd`)."""
# lazy imports: optional dependency megatron-core (through stage_host's agreement)
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd import hidden_teachers, step_repeats
from megatron_rl_patches.integrations.megatron.opd.opd_settings import OpdSettings
from megatron_rl_patches.integrations.megatron.opd.opd_teachers import OpdTeacher, ScoringStep, TeacherActor, TopkPass
from megatron_rl_patches.integrations.megatron.opd.stage_host import last_stage, pipeline_agrees
from megatron_rl_patches.integrations.megatron.opd.topk_request import (
    CROSS_ALIVE,
    CROSS_LOGPROBS,
    CROSS_RATIO,
    CROSS_TAILS,
    CROSS_TEACHERS,
    IDS,
    IDS_MASK,
    STEP_IDS,
    STEP_MASK,
    STEP_SAME_AS,
    TEACHER_LOGPROBS,
    TEACHER_TAILS,
    TopkRequest,
)
from megatron_rl_patches.teachers.scores import TeacherScores

Cut = Callable[[list[torch.Tensor], dict], list[torch.Tensor]]


def score_step(actor: TeacherActor, rollout_data: dict, settings: OpdSettings, teachers: list[OpdTeacher],
               passes: TopkPass, invariant: bool | None = None,
               cut_rows: Cut | None = None) -> tuple[ScoringStep, list[TeacherScores]] | None:
    """One step's teachers: each one's `begin` first (a served teacher's requests go then,
    overlapping the student's pass), then the full vocabulary's hidden states and heads, stored by
    `hidden_teachers.score_teachers` (None), or the top-k ids and every teacher's scores
    (`score_teachers`): the step and its scores to store on the last stage (None elsewhere, and
    where no stage had ids). The actor's own weights are active again after any teacher's pass."""
    for teacher in teachers:
        teacher.begin(actor, rollout_data)
    if settings.full_vocab:  # no ids: each teacher's hidden states and head (`vocab_opd`)
        hidden_teachers.score_teachers(actor, rollout_data, teachers, last_stage(), passes)
        actor.switch_snapshot("actor")
        return None
    scored = score_teachers(actor, rollout_data, settings, teachers, passes, invariant=invariant, cut_rows=cut_rows)
    if scored is None:  # no stage had ids: no teacher pass ran
        return None
    actor.switch_snapshot("actor")
    step, scores = scored
    return (step, [out for out in scores if out is not None]) if step.last else None


def score_teachers(actor: Any, rollout_data: dict, settings: OpdSettings, teachers: list[OpdTeacher],
                   passes: TopkPass, invariant: bool | None = None,
                   cut_rows: Cut | None = None) -> tuple[ScoringStep, list[TeacherScores | None]] | None:
    """The student's top-k ids (its pass by `passes`, in the rollout data on the last stage), then
    every teacher's scores: the step and the scores (the host stores them on `step.last`); None
    where no stage has ids (each teacher's started work ended by `unscored`)."""
    student = passes(actor.args, actor.model, rollout_data, TopkRequest(k=settings.top_k))
    ids = student.get("topk_ids")
    # Every pipeline stage takes part in each teacher's pipelined pass, in the same order; the ids
    # live on the last stage only, so whether the passes run is the last stage's answer, agreed.
    if not pipeline_agrees(ids is not None or not last_stage()):
        for teacher in teachers:  # a served teacher's requests collected, its job-wide agreement joined
            teacher.unscored()
        return None
    last = ids is not None
    if last:
        rollout_data[IDS] = ids
        rollout_data.pop(IDS_MASK, None)
    step = ScoringStep(actor, rollout_data, settings, last, student, passes, invariant=invariant, cut_rows=cut_rows)
    return step, [teacher.score(step) for teacher in teachers]


def store_scores(step: ScoringStep, scores: list[TeacherScores]) -> None:
    """The teachers' scores in the rollout data: those of the step's ids stacked per sample as
    [n, R, k] / [n, R]; those of grouped buckets (another tokenizer) with the step's ids and their
    own (`place`)."""
    rollout_data = step.rollout_data
    on_ids = [out for out in scores if out.ids is None]
    grouped = [out for out in scores if out.ids is not None]
    indices = [index for index, out in enumerate(scores) if out.ids is not None]
    if on_ids:
        rollout_data[TEACHER_LOGPROBS] = [torch.stack(per_teacher) for per_teacher in
                                          zip(*(out.log_probs for out in on_ids))]
        rollout_data[TEACHER_TAILS] = [torch.stack(per_teacher) for per_teacher in zip(*(out.tails for out in on_ids))]
    if grouped:
        place(rollout_data, grouped, same=bool(on_ids), union=step.settings.ids_from == "union", indices=indices,
              cut=step.cut)


def place(rollout_data: dict, scored: list[TeacherScores], same: bool, union: bool,
          indices: list[int], cut: Cut) -> None:
    """The cross teachers' fields in the rollout data, `cut` to this rank's rows: per sample the
    step's ids (the same-tokenizer ids when `same`, then each teacher's bucket ids), the stacked
    per-teacher values, and which teachers (`indices`: their places in the settings) gave them."""
    n = len(rollout_data["tokens"])
    parts: list[list[torch.Tensor]] = [[] for _ in range(n)]
    masks: list[list[torch.Tensor]] = [[] for _ in range(n)]
    if same:
        for i, ids in enumerate(rollout_data[IDS]):
            parts[i].append(ids)
            masks[i].append(rollout_data[IDS_MASK][i] if union else torch.ones_like(ids, dtype=torch.bool))
    depth = max(_first(out.ids).shape[-1] // _first(out.alive).shape[-1] for out in scored)
    for out in scored:
        pairs = zip(cut(grouped_field(out.ids), rollout_data), cut(grouped_field(out.ids_mask), rollout_data),
                    grouped_field(out.alive))
        for i, (ids, mask, alive) in enumerate(pairs):
            device = rollout_data[IDS][i].device
            parts[i].append(_deepened(ids, alive.shape[-1], depth).to(device))
            masks[i].append(_deepened(mask, alive.shape[-1], depth).to(device))
    rollout_data[STEP_IDS] = [torch.cat(p, dim=1) for p in parts]
    once = [step_repeats.unrepeated(ids, torch.cat(m, dim=1)) for ids, m in zip(rollout_data[STEP_IDS], masks)]
    rollout_data[STEP_MASK] = [mask for mask, _ in once]
    rollout_data[STEP_SAME_AS] = [same_as for _, same_as in once]
    for key, field in ((CROSS_RATIO, "log_ratio"), (CROSS_LOGPROBS, "log_probs"), (CROSS_TAILS, "tails"),
                       (CROSS_ALIVE, "alive")):
        per_teacher = [cut(grouped_field(getattr(out, field)), rollout_data) for out in scored]
        rollout_data[key] = [torch.stack(values, dim=1) for values in zip(*per_teacher)]
    rollout_data[CROSS_TEACHERS] = [torch.tensor(indices, dtype=torch.int64) for _ in range(n)]  # read by opd_terms


def grouped_field(values: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """A grouped-bucket field of `TeacherScores` (set by every teacher `place` receives)."""
    assert values is not None, "a teacher with grouped buckets gives ids, their mask, alive and log_ratio"
    return values



def _first(values: list[torch.Tensor] | None) -> torch.Tensor:
    return grouped_field(values)[0]


def _deepened(values: torch.Tensor, k: int, depth: int) -> torch.Tensor:
    """[R, k·D] bucket slots as [R, k·depth] (each bucket padded with zeros / False to `depth` slots)."""
    rows = values.reshape(values.shape[0], k, -1)
    pad = rows.new_zeros((rows.shape[0], k, depth - rows.shape[-1]))
    return torch.cat([rows, pad], dim=-1).reshape(values.shape[0], -1)
