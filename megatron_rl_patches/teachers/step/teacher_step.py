"""The teacher step of any training loop, framework-free (`TeacherStep`): `send(batch)` before the
student's forward (or `add(batch)` as the rollout finishes each part of it, any number of times),
`collect()` after it: every added sample's scores in the order added; `metrics()` the step's
figures for a dashboard (`step_metrics`).

- Asynchronous teachers (`asynchronous.AsyncTeacher`: `ServedTeacher`, with or without a head) are
  asked on one rank of each sharing group (the host's `share_group`, its first rank) only; their
  requests run while the student's forward does.
- In-process teachers (any `BatchTeacher`: `.score(batch)`) run in `collect()` on every rank,
  through the host's `teacher_pass` when it gives one (they are model-parallel like the student).
- The ranks of a sharing group hold the same checkpoint's head, within the student's vocabulary
  (`step_heads`: compared when the step is built, a difference raised by the first `collect`).
- A failure anywhere (a server down, a sample too long, an in-process teacher raising) is agreed
  over the host's `job_group`: every rank raises the same error (`ServedTeacherError` /
  `ServedTeacherRefusal`), none is left waiting in a later collective. So is a bad call on one
  rank (`collect()` before `send()`, a batch that is not a `TeacherBatch`: its own TypeError /
  RuntimeError on every rank) and, when the step is built, a host whose sharing groups, vocabulary
  or teachers differ between the ranks (a ValueError on every rank: `step_views`, exchanged over
  the job before the sharing group's head comparison).
- The served scores are broadcast from the asking rank to its sharing group as tensors on the
  group's device (`share_tensors`: the layout first, then one flat buffer per dtype, never
  pickled); a head's hidden states are projected through the head on every rank after it (the
  head's tensor-parallel ops need every rank).

- A teacher with a privileged context (`Privileged(teacher, KEY)`, its entry's `;context=KEY`, or
  a key of its own: `privileged`) scores `with_context(batch, its contexts)`: the contexts come
  with the batch (`send(batch, contexts=...)`, `step_contexts`); its rows line up with the
  student's. The step owns the keys: each teacher's read once, when the step is built.

The step's `ScoringPlan` (`step.plan`: its top-k, temperature and invariant mode; `StepPlan`, its
earlier name) is the caller's, or the one its teachers were built with (`teacher_plan`): checked once
against each of them when the step is built, explicit (no context variable)."""
from __future__ import annotations

# lazy imports: import cost: torch.distributed and the head's ops only when a group or a head is used
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.ops.scoring_plan import ScoringPlan
from megatron_rl_patches.teachers.agreement import agree_failure, agreed_views, distributed
from megatron_rl_patches.teachers.asynchronous import AsyncTeacher, Pending
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.context.privileged import step_teachers
from megatron_rl_patches.teachers.contract import teacher_plan
from megatron_rl_patches.teachers.host import TeacherHost, asks
from megatron_rl_patches.teachers.step.contexts import teacher_batches
from megatron_rl_patches.teachers.step.given_rows import given_problem
from megatron_rl_patches.teachers.step.heads import step_heads_failure
from megatron_rl_patches.teachers.step.metrics import StepFigures, step_metrics
from megatron_rl_patches.teachers.step.parts import (
    JoinedPending,
    Ready,
    ScoredBefore,
    answer_runs,
    batch_part,
    joined_batch,
    scored_problem,
)


@dataclass
class Added:
    """One part of a step's samples (`TeacherStep.add`): the student's batch, each teacher's batch
    (the student's, or its context's) and the asynchronous teachers' requests (the asking rank's)."""

    batch: TeacherBatch
    batches: list[TeacherBatch]
    pending: dict[int, Pending]


StepPlan = ScoringPlan  # the step's plan under its earlier name (docs/distillation.md)


def step_plan(teachers: Sequence[Any], plan: ScoringPlan | None) -> ScoringPlan:
    """`plan`, checked against the plan every teacher was built with (`teacher_plan`: its K,
    temperature and invariant mode: the teachers score at theirs, so a step plan differing from one
    would be dropped); without one, the teachers' own (they must agree)."""
    plans = [teacher_plan(teacher) for teacher in teachers]
    if plan is None:
        if len(set(plans)) > 1:
            differ = sorted({(one.top_k, one.temperature, one.invariant) for one in plans}, key=repr)  # a K or VOCAB
            raise ValueError(f"TeacherStep: the teachers' (top_k, temperature, invariant) differ ({differ}): give "
                             f"every teacher the same plan, or pass plan=ScoringPlan(...) matching them")
        return plans[0]
    for teacher, own in zip(teachers, plans):
        if own != plan:
            modes = ("", "") if own.invariant == plan.invariant else (mode_words(own), mode_words(plan))
            raise ValueError(f"TeacherStep: {teacher!r} scores top_k={own.top_k} at temperature {own.temperature}"
                             f"{modes[0]}, the plan asks top_k={plan.top_k} at {plan.temperature}{modes[1]}: build "
                             f"the teacher with the plan (plan=...)")
    return plan


def mode_words(plan: ScoringPlan) -> str:
    """The plan's invariant mode, as a message shows it."""
    setting = ": the setting MEGATRON_RL_PATCHES_INVARIANT" if plan.invariant is None else ""
    return f" (invariant={plan.invariant}{setting})"


def checked(teachers: Sequence[Any], host: TeacherHost,
            plan: ScoringPlan | None) -> tuple[list[Any], list[str | None], ScoringPlan]:
    """The step's teachers as a list (a `Privileged` one unwrapped), their context keys and its
    plan, each argument checked (TypeError / ValueError naming it)."""
    if isinstance(teachers, (str, bytes)) or not isinstance(teachers, Sequence) or not teachers:
        raise TypeError("TeacherStep(teachers=...) must be a non-empty list of teachers (ServedTeacher or any "
                        f"object with .top_k and .score(batch)), got {type(teachers).__name__}")
    teachers, keys = step_teachers(teachers)
    for i, teacher in enumerate(teachers):
        if not callable(getattr(teacher, "score", None)) or not hasattr(teacher, "top_k"):
            raise TypeError(f"TeacherStep(teachers=...): teacher {i} ({type(teacher).__name__}) has no "
                            f".score(batch) and .top_k: pass a ServedTeacher or a BatchTeacher")
    for name in ("share_group", "job_group", "vocab_size", "teacher_pass"):
        if not hasattr(host, name):
            raise TypeError(f"TeacherStep(host=...) has no {name}: pass a TeacherHost (e.g. "
                            f"megatron_host(vocab_size) or local_host(vocab_size))")
    if plan is not None and not isinstance(plan, ScoringPlan):
        raise TypeError(f"TeacherStep(plan=...) must be a ScoringPlan or None, got {type(plan).__name__}")
    return teachers, keys, step_plan(teachers, plan)


def join_build(host: TeacherHost) -> None:
    """On a rank of the host's job group that builds no `TeacherStep` where the others build one
    (slime's earlier pipeline stages): its part of the build's agreement (a disagreement, or a rank
    that refused its step's arguments, raised here too)."""
    from megatron_rl_patches.teachers.step.views import absent_view, agreement_group, check_built

    check_built(agreed_views(None, agreement_group(host), absent_view(host)))


class TeacherStep:
    """Teachers asked for one step's samples: `send(batch)` (or `add(batch)` for each part, as the
    rollout finishes it) then, after the student's forward, `collect()` -> one `BatchScores` per
    teacher over every sample handed over, in the teachers' order, equal on every rank of a
    sharing group; `metrics()` the step's figures. Every rank of the host's groups builds it and
    calls both, in the same order (a rank of the job holding no step joins its build with
    `join_build(host)` and each collect with `agree_failure(None, host.job_group)`).

    Every check of a call that leads to a collective is agreed over the job group
    (`agreement_group`) before it: one rank's bad call, or a host whose groups, vocabulary or
    teachers differ between the ranks, is the same error on every rank, never a rank left waiting.
    Building exchanges each rank's view (`step_views`); `send` / `add` exchange nothing: a refusal is
    kept and raised at once only without a group to agree over, else agreed (on every rank) by the
    `collect` that follows, which every rank makes in any case; `collect` also compares its
    `projected` and the batch each rank of a sharing group sent."""

    def __init__(self, teachers: Sequence[Any], host: TeacherHost, plan: ScoringPlan | None = None) -> None:
        from megatron_rl_patches.teachers.step.views import agreement_group, built_view, check_built

        self.group = agreement_group(host)
        self.teachers: list[Any] = []
        self.keys: list[str | None] = []  # each teacher's context key (None: the student's batch), read once here
        self.plan: ScoringPlan | None = None
        self.host = host
        self.added: list[Added] = []  # the parts handed over since the last collect, in order
        self.failed: BaseException | None = None  # a bad context found in add(), agreed in collect()
        self.refused: Exception | None = None  # a refused send / add (a bad call), agreed by the next collect
        self.figures = StepFigures()  # since the last metrics()
        error: Exception | None = None
        view = None
        try:
            self.teachers, self.keys, self.plan = checked(teachers, host, plan)
            view = built_view(host, self.teachers, self.keys, self.plan)
        except Exception as failed:  # noqa: BLE001 - agreed over the job just below, raised on every rank
            error = failed
        check_built(agreed_views(error, self.group, view, own=True))
        self.asker = view["share"][0] if view is not None else 0  # the global rank asking for this rank's group
        # the teachers asked on the asking rank and shared (the others: in-process, on every rank)
        self.asynchronous = [isinstance(teacher, AsyncTeacher) for teacher in self.teachers]
        self.metrics()  # the step's figures start here (a served teacher's connect and probes are not a step's)
        # the sharing groups agree now: the heads' exchange over the sharing group cannot wait for a rank outside it
        self.heads_failure = step_heads_failure(self.teachers, host)  # raised by the first collect, agreed

    def asks(self) -> bool:
        """Whether this rank asks the served teachers: the first rank of its sharing group."""
        return asks(self.host)

    def alone(self) -> bool:
        """Nothing to agree with: no group, torch.distributed not initialized, or a group of one."""
        if self.group is None or not distributed():
            return True
        import torch.distributed as dist  # lazy: import cost: torch only with a group

        return dist.get_world_size(self.group) == 1

    @property
    def batch(self) -> TeacherBatch | None:
        """The samples handed over since the last `collect()`, joined in order (None: none)."""
        return joined_batch([part.batch for part in self.added]) if self.added else None

    def send(self, batch: TeacherBatch, contexts: Any = None) -> None:
        """The step's samples in one part: `add(batch, contexts)` where nothing waits to be
        collected (a second `send` before `collect()` is refused: a loop that forgot its collect;
        a step handed over in parts takes `add`)."""
        if self.added or self.refused is not None:
            self.refuse(RuntimeError("TeacherStep.send: the last batch was not collected: call collect() once per "
                                     "send(), or add(batch) for each part of one step"))
            return
        self.hand_over(batch, contexts, "send")

    def add(self, batch: TeacherBatch, contexts: Any = None, *, scored: Mapping[int, Any] | None = None) -> None:
        """Hand `batch` to the step now (the rollout finished these samples): the served teachers
        are asked for it at once, in the background, on the asking rank; any number of times before
        `collect()`, which returns every added sample's scores in the order added (the in-process
        teachers score the joined batch there). Every rank of the sharing group adds the same
        samples (in any parts: the joined batch is compared). `contexts`: the privileged contexts of
        this part's samples for the teachers with a `context` key (`{KEY: [one per sample]}` or one
        `{KEY: context}` mapping per sample; `step_contexts`): each such teacher scores
        `with_context(batch, its contexts)`. A bad call or a bad context raises here in one process;
        with a group the following `collect` raises it on every rank of the job.

        `scored`: {teacher index: what it answered for this part} for asynchronous teachers that
        already scored these samples elsewhere (a rollout's teacher, asked as each generation
        ended): not asked again; their answer (as `submit(...).result(projected=False)` gives it:
        `BatchScores`, or a head's states per sample) joins the others' in `collect()`, read on
        the asking rank and shared like an answer. A `ScoredBefore` (`teachers.step.parts`) gives
        answers per sample with the digest of the ids each scored: the step reads those whose digest
        is that of its own batch for the teacher (the sample's ids, or its context's before them)
        and asks the teacher for the others (slime's carried rows, `opd/carried_rows.py`). What it
        reads must hold what the teacher would have sent (`given_rows`: the checks of a served
        reply), or it is refused naming the sample and where the rows came from."""
        self.hand_over(batch, contexts, "add", scored)

    def hand_over(self, batch: TeacherBatch, contexts: Any, call: str, scored: Any = None) -> None:
        """`add`'s work (`call`: the method the user called, named in a refusal)."""
        if not isinstance(batch, TeacherBatch):
            self.refuse(TypeError(f"TeacherStep.{call}(batch) takes a TeacherBatch, got {type(batch).__name__}"))
            return
        wrong = scored_problem(scored, self.asynchronous, len(batch))
        if wrong is not None:
            self.refuse(wrong)
            return
        self.figures.adds += 1
        if self.refused is not None or self.failed is not None:  # collect() fails the step: nothing more is asked
            self.added.append(Added(batch, [batch] * len(self.teachers), {}))
            return
        try:
            batches = teacher_batches(self.teachers, self.keys, batch, contexts, self.host.vocab_size)
            # each given answer in runs of the part: read (a ScoredBefore's where its digest matches) or asked
            runs = {i: answer_runs(got, batches[i]) for i, got in (scored or {}).items()}
            for i, parts in runs.items():  # what is read holds what the teacher would have sent (given_rows)
                got = (scored or {})[i]
                wrong = given_problem(self.teachers[i], i, parts, batches[i],
                                      *((got.origin, got.vocab_size) if isinstance(got, ScoredBefore) else ()))
                if wrong is not None:
                    raise wrong
        except (TypeError, ValueError) as error:
            if self.alone():
                raise
            self.added.append(Added(batch, [batch] * len(self.teachers), {}))
            self.failed = error  # agreed in collect()
            return
        self.figures.scored_before += max((sum(hi - lo for lo, hi, got in parts if got is not None)
                                           for parts in runs.values()), default=0)
        pending: dict[int, Pending] = {}
        if self.asks() and self.heads_failure is None:
            for i, teacher in enumerate(self.teachers):
                if self.asynchronous[i]:
                    asked = [Ready(got) if got is not None else teacher.submit(batch_part(batches[i], lo, hi))
                             for lo, hi, got in runs.get(i, [(0, len(batch), None)])]
                    pending[i] = asked[0] if len(asked) == 1 else JoinedPending(asked)
        self.added.append(Added(batch, batches, pending))

    def refuse(self, refused: Exception) -> None:
        """A bad call: raised at once without a group, else kept for the next `collect` to agree."""
        if self.alone():
            raise refused
        self.refused = self.refused or refused

    def metrics(self) -> dict[str, Any]:
        """The step's figures since the last call, or since it was built (call it once a step,
        after `collect()`): its samples, rows, parts, seconds in `collect()` and of those waited for
        the asynchronous teachers, and its served teachers' figures (`ServedTeacher.metrics()`:
        bytes, retries, failovers, hedges, replicas taken out, per replica latency p50 / p95)
        summed and per teacher (`step_metrics`; `step_metrics.flat` gives `teacher/...` keys).
        Counting starts again at zero."""
        served = {i: teacher.metrics() for i, teacher in enumerate(self.teachers)
                  if self.asynchronous[i] and callable(getattr(teacher, "metrics", None))}
        return step_metrics(self.figures.take(), served)

    def collect(self, projected: bool = True) -> list[Any]:
        """Every teacher's scores of the samples sent (or added, joined in the order added; a
        failure anywhere, or a bad call on any rank, raised alike on every rank of the job
        group); with `projected=False` a head teacher's hidden states [R_i, H] per sample as the
        server sent them (full-vocabulary divergences take the states, not scores)."""
        from megatron_rl_patches.teachers.step.views import check_collect, collect_view, served_contexts

        started = time.perf_counter()
        parts, error, refused = self.added, self.failed, self.refused
        self.added, self.failed, self.refused = [], None, None
        if refused is None and not parts:
            refused = RuntimeError("TeacherStep.collect: nothing sent: call send(batch) first")
        if refused is None and not isinstance(projected, bool):
            refused = TypeError(f"TeacherStep.collect(projected=...) must be True or False, got {projected!r}")
        pending = {i: JoinedPending([part.pending[i] for part in parts if i in part.pending])
                   for i in range(len(self.teachers)) if any(i in part.pending for part in parts)}
        if refused is not None or error is not None:
            for waiting in pending.values():
                waiting.cancel()
            pending = {}  # the parts asked before the failure: dropped, the step fails below
        if refused is not None:
            agree_failure(refused, self.group, own=True)
        batch = joined_batch([part.batch for part in parts])
        batches = [joined_batch([part.batches[i] for part in parts]) for i in range(len(self.teachers))]
        if not all(self.asynchronous):
            # every rank has its batches before any runs an in-process pass, and the ranks of a sharing group
            # hold the same ones (a model-parallel pass over different sequences would hang in its collectives)
            own = [b for b, asked in zip(batches, self.asynchronous) if not asked]
            check_collect(agreed_views(error, self.group, collect_view(projected, self.asker, batch, own)))
        got: dict[int, Any] = {}
        asking, waited = time.perf_counter(), 0.0  # the seconds the asking rank waits for the served answers
        try:
            if self.heads_failure is not None:
                raise self.heads_failure
            for i, waiting in pending.items():
                got[i] = waiting.result(projected=False)  # a head's states: projected on every rank below
            waited = time.perf_counter() - asking
            for i, teacher in enumerate(self.teachers):
                if error is None and not self.asynchronous[i]:
                    run = self.host.teacher_pass
                    got[i] = teacher.score(batches[i]) if run is None else run(teacher, batches[i])
        except Exception as failed:  # noqa: BLE001 - agreed over the job just below, raised on every rank
            error = failed
            for waiting in pending.values():
                waiting.cancel()
        # digests, compared before the asking rank's scores are shared
        sent = served_contexts(self.teachers, self.keys, batches)
        check_collect(agreed_views(error, self.group, collect_view(projected, self.asker, batch, sent=sent)))
        asked = [i for i, is_asked in enumerate(self.asynchronous) if is_asked]
        got.update(self.shared({i: got[i] for i in asked if i in got}))
        self.counted(batch, waited)
        if not projected:
            out = [got[i] for i in range(len(self.teachers))]
        else:
            out = [teacher.project(batches[i], got[i]) if self.asynchronous[i] else got[i]
                   for i, teacher in enumerate(self.teachers)]
        self.figures.collect_s += time.perf_counter() - started
        return out

    def counted(self, batch: TeacherBatch, waited: float) -> None:
        """A collected step in the figures: its samples and rows, the seconds it waited."""
        self.figures.collects += 1
        self.figures.samples += len(batch)
        self.figures.rows += sum(batch.response_rows(i) for i in range(len(batch)))
        self.figures.collect_wait_s += waited

    def shared(self, served: dict[int, Any]) -> dict[int, Any]:
        """The asking rank's asynchronous teachers' results on every rank of its sharing group (as
        tensors, never pickled)."""
        group = self.host.share_group
        if group is None or not distributed() or not any(self.asynchronous):
            return served
        from megatron_rl_patches.teachers.step.share_tensors import shared_results  # lazy: import cost: torch

        return shared_results(served if self.asks() else None, group)
