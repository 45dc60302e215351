"""slime_opd's served teachers (`http://host:port;engine=vllm[;tokenizer=DIR|;head=DIR]`) on the
framework-free teacher step: `ServedOpdTeacher` sends the step's samples through a
`teachers.TeacherStep` behind the actor's host (`stage_host.stage_host`) before the student's pass
(`begin`) and collects them in the teacher's turn (`score`). Each sample is asked once per
data-parallel rank, by the first rank of the last pipeline stage's tensor and context-parallel
group, which broadcasts the scores to the rest of that group (a head's hidden states too: every
rank projects them through its shard of the head); a failure on any rank is the same error on
every rank of the job. What the scores give is the framework-free role's (`teachers.step.served`);
here they are cut to each context-parallel rank's zigzag rows and placed in slime's rollout data."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_rl_patches.integrations.megatron.opd.carried_rows import add_carried
from megatron_rl_patches.integrations.megatron.opd.cross_passes import context_of, teacher_samples
from megatron_rl_patches.integrations.megatron.opd.opd_teachers import OpdTeacher, ScoringStep
from megatron_rl_patches.integrations.megatron.opd.stage_host import StageHost, batch_of, device_of
from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS, FIGURES, IDS, IDS_MASK
from megatron_rl_patches.integrations.megatron.opd.zigzag import whole_from_zigzag, zigzag_of_whole
from megatron_rl_patches.teachers.agreement import agree_failure
from megatron_rl_patches.teachers.context.cross import cross_with_context
from megatron_rl_patches.teachers.context.privileged import Privileged
from megatron_rl_patches.teachers.head.cross_buckets import cross_batch
from megatron_rl_patches.teachers.scores import TeacherScores
from megatron_rl_patches.teachers.step.metrics import fixed_figures
from megatron_rl_patches.teachers.step.served import CrossServed, HeadServed, OwnTopkServed
from megatron_rl_patches.teachers.step.teacher_step import TeacherStep, join_build

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.teachers.contract import BatchScores

Role = OwnTopkServed | CrossServed | HeadServed


class ServedOpdTeacher(OpdTeacher):
    """A served teacher of slime's OPD: its `role` (None off the last pipeline stage: those ranks
    only join the job's agreement) on a one-teacher `TeacherStep` behind `host`; `cross`: a teacher
    of another tokenizer (on every stage: it takes no request for the step's ids, so every stage
    hands the later teachers the same requests); `context`: the entry's `;context=KEY`, whose one
    owner it is (its client is built without it): the step is handed `Privileged(client, KEY)`, or,
    for another tokenizer, the teacher's own encodings go after each sample's context."""

    def __init__(self, role: Role | None, host: StageHost, cross: bool = False, context: str | None = None) -> None:
        self.role, self.host, self.cross = role, host, cross or isinstance(role, CrossServed)
        self.context = context
        self.step = None if role is None else TeacherStep([self.stepped(role.teacher)], host)
        if role is None:  # the earlier stages' part of the last stage's build agreement
            join_build(host)
        self.samples: list | None = None  # another tokenizer's encodings of the step's samples

    def stepped(self, client: Any) -> Any:
        """The client as its step takes it: with the key (of the student's tokenizer: the step puts
        the contexts before the responses), or as it is."""
        return client if self.context is None or self.cross else Privileged(client, self.context)

    @property
    def teacher(self) -> Any:
        """The `ServedTeacher` (None off the last stage)."""
        return None if self.role is None else self.role.teacher

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.teacher!r})"

    def begin(self, actor: Any, rollout_data: dict) -> None:
        """The step's samples sent now (by the asking rank), before the student's pass."""
        if self.step is None:
            return
        if isinstance(self.role, CrossServed):
            self.samples = teacher_samples(rollout_data, self.role.pair)
            if self.context is not None:  # its own encodings after each sample's context (the teacher's ids)
                self.samples = cross_with_context(self.samples, context_of(rollout_data, self.context))
            self.step.send(cross_batch(self.samples))
        else:
            # a privileged teacher (`;context=KEY`) scores each sample's context + response; rows a rollout's
            # served teacher gave (slime's MEGATRON_RL_PATCHES_OPD_SCORE_AT=rollout) are read, not asked again
            batch, contexts = batch_of(rollout_data), rollout_data.get(CONTEXTS)
            if not add_carried(self.step, batch, contexts, rollout_data):
                self.step.send(batch, contexts=contexts)

    def unscored(self) -> None:
        """The step scores no teacher: its requests collected all the same, so the job's agreement
        on them is joined by this rank too."""
        self.collected()

    def collected(self, projected: bool = True) -> BatchScores | list | None:
        """The step's scores on the last stage's ranks (None on the others; with `projected=False`
        a head's hidden states [R_i, H] per sample as sent: `vocab_opd`); a failure on any rank
        raised on every rank of the job."""
        if self.step is None:
            agree_failure(None, self.host.job_group)
            return None
        if self.step.batch is None:
            agree_failure(RuntimeError("slime_opd: a served teacher's step was not sent before its turn; please "
                                       "report this"), self.host.job_group)
        (scores,) = self.step.collect(projected=projected)
        return scores

    def score(self, step: ScoringStep) -> TeacherScores | None:
        if self.cross:
            return self.cross_scores(step)
        request = step.ids_request()
        scores = self.collected()
        if scores is None:
            return None
        assert not isinstance(scores, list)  # projected: the head's scores
        data = step.rollout_data
        lengths = [int(t) for t in data["total_lengths"]], [int(r) for r in data["response_lengths"]]
        device = device_of(data)

        def cut(rows: list) -> list:
            return zigzag_of_whole([r.to(device) for r in rows], *lengths)

        if request.k is not None and not request.union:  # its own top-k become the step's ids
            assert self.role is not None  # the last stage's
            ids, values, tails = self.role.rows(scores) if isinstance(self.role, OwnTopkServed) else \
                (scores.topk_ids, [v.float() for v in scores.topk_log_probs],
                 [t.float() for t in scores.tail_log_probs])
            data[IDS] = cut(ids)
            data.pop(IDS_MASK, None)
            return TeacherScores(cut(values), cut(tails))
        assert isinstance(self.role, HeadServed)  # check_served: only a head scores given ids (or is not first)
        given = [i.cpu() for i in whole_from_zigzag(list(data[IDS]), *lengths)]
        mask = None if IDS_MASK not in data else [m.cpu() for m in whole_from_zigzag(list(data[IDS_MASK]), *lengths)]
        ids, mask = self.role.joined(given, mask, scores, request.union)
        values, tails = self.role.at_ids(scores, ids, mask)
        if request.union:  # the union replaces the step's ids: the later teachers score it with its mask
            data[IDS] = cut(ids)
            data[IDS_MASK] = cut(mask)  # type: ignore[arg-type]
        return TeacherScores(cut(values), cut(tails))

    def cross_scores(self, step: ScoringStep) -> TeacherScores | None:
        """Another tokenizer's buckets on the student's whole rows (as `topk_teachers.place` stores them)."""
        scores = self.collected()
        if scores is None:
            return None
        assert not isinstance(scores, list)  # projected: the head's scores
        assert isinstance(self.role, CrossServed) and self.samples is not None  # `begin`'s, on the last stage
        samples, self.samples = self.samples, None
        return self.role.scores(scores, samples, step.student_log_probs, device_of(step.rollout_data))


def note_figures(teachers: Sequence[Any], rollout_data: dict) -> None:
    """The step's served teachers' figures (those holding a `TeacherStep`: the last stage's) in
    `rollout_data[FIGURES]` (`step_metrics.fixed_figures`: the same keys on every rank, for the host
    to average); nothing where none holds one."""
    steps = [teacher.step for teacher in teachers if isinstance(teacher, ServedOpdTeacher) and teacher.step is not None]
    if steps:
        rollout_data[FIGURES] = fixed_figures([step.metrics() for step in steps])
