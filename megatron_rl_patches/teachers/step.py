"""The teacher step of any training loop, framework-free (`TeacherStep`): `send(batch)` before the
student's forward, `collect()` after it.

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

- A teacher with a privileged context (`context=KEY`: its entry's `;context=KEY`) scores
  `with_context(batch, its contexts)`: the contexts come with the batch
  (`send(batch, contexts=...)`, `step_contexts`); its rows line up with the student's.

`StepPlan` carries the step's top-k, temperature and invariant mode explicitly (no context
variable): built from the teachers when not given, checked once against each of them."""
from __future__ import annotations

# lazy imports: import cost: torch.distributed and the head's ops only when a group or a head is used
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.teachers.agreement import agree_failure, agreed_views, distributed
from megatron_rl_patches.teachers.asynchronous import AsyncTeacher, Pending
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.context_key import teacher_context
from megatron_rl_patches.teachers.host import TeacherHost, asks
from megatron_rl_patches.teachers.step_contexts import teacher_batches
from megatron_rl_patches.teachers.step_heads import step_heads_failure


@dataclass(frozen=True)
class StepPlan:
    """The step's top-k buckets per row, temperature and invariant mode (the student's ops read
    them from here: passed down as arguments, never through module or context state)."""

    top_k: int
    temperature: float = 1.0
    invariant: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"StepPlan(top_k={self.top_k!r}): pass a positive int (the teacher's buckets per row)")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature > 0:
            raise ValueError(f"StepPlan(temperature={self.temperature!r}): pass a positive float")
        if not isinstance(self.invariant, bool):
            raise TypeError(f"StepPlan(invariant=...) must be a bool, got {type(self.invariant).__name__}")


def plan_of(teachers: Sequence[Any], plan: StepPlan | None) -> StepPlan:
    """`plan`, checked against every teacher's top_k / temperature; without one, the teachers' own
    (they must agree)."""
    keys = {(teacher.top_k, float(getattr(teacher, "temperature", 1.0))) for teacher in teachers}
    if plan is None:
        if len(keys) > 1:
            raise ValueError(f"TeacherStep: the teachers' (top_k, temperature) differ ({sorted(keys)}): give every "
                             f"teacher the same, or pass plan=StepPlan(...) matching them")
        top_k, temperature = keys.pop()
        return StepPlan(top_k, temperature)
    for teacher in teachers:
        if (teacher.top_k, float(getattr(teacher, "temperature", 1.0))) != (plan.top_k, float(plan.temperature)):
            raise ValueError(f"TeacherStep: {teacher!r} scores top_k={teacher.top_k} at temperature "
                             f"{getattr(teacher, 'temperature', 1.0)}, the plan asks top_k={plan.top_k} at "
                             f"{plan.temperature}: build the teacher with the plan's values")
    return plan


def checked(teachers: Sequence[Any], host: TeacherHost, plan: StepPlan | None) -> tuple[list[Any], StepPlan]:
    """The step's teachers as a list and its plan, each argument checked (TypeError / ValueError
    naming it)."""
    if isinstance(teachers, (str, bytes)) or not isinstance(teachers, Sequence) or not teachers:
        raise TypeError("TeacherStep(teachers=...) must be a non-empty list of teachers (ServedTeacher or any "
                        f"object with .top_k and .score(batch)), got {type(teachers).__name__}")
    for i, teacher in enumerate(teachers):
        if not callable(getattr(teacher, "score", None)) or not hasattr(teacher, "top_k"):
            raise TypeError(f"TeacherStep(teachers=...): teacher {i} ({type(teacher).__name__}) has no "
                            f".score(batch) and .top_k: pass a ServedTeacher or a BatchTeacher")
        teacher_context(teacher, i)
    for name in ("share_group", "job_group", "vocab_size", "teacher_pass"):
        if not hasattr(host, name):
            raise TypeError(f"TeacherStep(host=...) has no {name}: pass a TeacherHost (e.g. "
                            f"megatron_host(vocab_size) or local_host(vocab_size))")
    if plan is not None and not isinstance(plan, StepPlan):
        raise TypeError(f"TeacherStep(plan=...) must be a StepPlan or None, got {type(plan).__name__}")
    return list(teachers), plan_of(teachers, plan)


def join_build(host: TeacherHost) -> None:
    """On a rank of the host's job group that builds no `TeacherStep` where the others build one
    (slime's earlier pipeline stages): its part of the build's agreement (a disagreement, or a rank
    that refused its step's arguments, raised here too)."""
    from megatron_rl_patches.teachers.step_views import absent_view, agreement_group, check_built

    check_built(agreed_views(None, agreement_group(host), absent_view(host)))


class TeacherStep:
    """Teachers asked for one step's samples: `send(batch)` then, after the student's forward,
    `collect()` -> one `BatchScores` per teacher, in the teachers' order, equal on every rank of a
    sharing group. Every rank of the host's groups builds it and calls both, in the same order (a
    rank of the job holding no step joins its build with `join_build(host)` and each collect with
    `agree_failure(None, host.job_group)`).

    Every check of a call that leads to a collective is agreed over the job group
    (`agreement_group`) before it: one rank's bad call, or a host whose groups, vocabulary or
    teachers differ between the ranks, is the same error on every rank, never a rank left waiting.
    Building exchanges each rank's view (`step_views`); `send` exchanges nothing: its refusal is
    kept and raised at once only without a group to agree over, else agreed (on every rank) by the
    `collect` that follows, which every rank makes in any case; `collect` also compares its
    `projected` and the batch each rank of a sharing group sent."""

    def __init__(self, teachers: Sequence[Any], host: TeacherHost, plan: StepPlan | None = None) -> None:
        from megatron_rl_patches.teachers.step_views import agreement_group, built_view, check_built

        self.group = agreement_group(host)
        self.teachers: list[Any] = []
        self.plan: StepPlan | None = None
        self.host = host
        self.batch: TeacherBatch | None = None
        self.batches: list[TeacherBatch] = []  # per teacher: the student's batch, or its context's
        self.failed: BaseException | None = None  # a bad context found in send(), agreed in collect()
        self.refused: Exception | None = None  # a refused send (a bad call), agreed by the next collect
        self.pending: dict[int, Pending] = {}
        error: Exception | None = None
        view = None
        try:
            self.teachers, self.plan = checked(teachers, host, plan)
            view = built_view(host, self.teachers, self.plan)
        except Exception as failed:  # noqa: BLE001 - agreed over the job just below, raised on every rank
            error = failed
        check_built(agreed_views(error, self.group, view, own=True))
        self.asker = view["share"][0] if view is not None else 0  # the global rank asking for this rank's group
        # the teachers asked on the asking rank and shared (the others: in-process, on every rank)
        self.asynchronous = [isinstance(teacher, AsyncTeacher) for teacher in self.teachers]
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

    def send(self, batch: TeacherBatch, contexts: Any = None) -> None:
        """Send `batch` to the served teachers (on the asking rank; at once, in the background).
        Every rank of the sharing group passes the same batch. `contexts`: the privileged contexts
        of the teachers with a `context` key (`{KEY: [one per sample]}` or one `{KEY: context}`
        mapping per sample; `step_contexts`): each such teacher scores `with_context(batch, its
        contexts)`. A bad call or a bad context raises here in one process; with a group the
        following `collect` raises it on every rank of the job."""
        refused: Exception | None = None
        if not isinstance(batch, TeacherBatch):
            refused = TypeError(f"TeacherStep.send(batch) takes a TeacherBatch, got {type(batch).__name__}")
        elif self.batch is not None or self.refused is not None:
            refused = RuntimeError("TeacherStep.send: the last batch was not collected: call collect() once per send()")
        if refused is not None:
            if self.alone():
                raise refused
            self.refused = self.refused or refused
            return
        try:
            self.batches = teacher_batches(self.teachers, batch, contexts, self.host.vocab_size)
        except (TypeError, ValueError) as error:
            if self.alone():
                raise
            self.batch, self.batches, self.failed = batch, [batch] * len(self.teachers), error  # agreed in collect()
            return
        self.batch = batch
        if self.asks() and self.heads_failure is None:
            self.pending = {i: teacher.submit(self.batches[i]) for i, teacher in enumerate(self.teachers)
                            if self.asynchronous[i]}

    def collect(self, projected: bool = True) -> list[Any]:
        """Every teacher's scores of the sent batch (a failure anywhere, or a bad call on any rank,
        raised alike on every rank of the job group); with `projected=False` a head teacher's
        hidden states [R_i, H] per sample as the server sent them (full-vocabulary divergences
        take the states, not scores)."""
        from megatron_rl_patches.teachers.step_views import check_collect, collect_view, served_contexts

        batch, batches, pending, error, refused = self.batch, self.batches, self.pending, self.failed, self.refused
        self.batch, self.batches, self.pending, self.failed, self.refused = None, [], {}, None, None
        if refused is None and batch is None:
            refused = RuntimeError("TeacherStep.collect: nothing sent: call send(batch) first")
        if refused is None and not isinstance(projected, bool):
            refused = TypeError(f"TeacherStep.collect(projected=...) must be True or False, got {projected!r}")
        if refused is not None or error is not None:
            for waiting in pending.values():
                waiting.cancel()
        if refused is not None:
            agree_failure(refused, self.group, own=True)
        elif not all(self.asynchronous):
            # every rank has its batches before any runs an in-process pass, and the ranks of a sharing group
            # hold the same ones (a model-parallel pass over different sequences would hang in its collectives)
            own = [b for b, asked in zip(batches, self.asynchronous) if not asked]
            check_collect(agreed_views(error, self.group, collect_view(projected, self.asker, batch, own)))
        assert batch is not None  # refused on every rank above otherwise
        got: dict[int, Any] = {}
        try:
            if self.heads_failure is not None:
                raise self.heads_failure
            for i, waiting in pending.items():
                got[i] = waiting.result(projected=False)  # a head's states: projected on every rank below
            for i, teacher in enumerate(self.teachers):
                if error is None and not self.asynchronous[i]:
                    run = self.host.teacher_pass
                    got[i] = teacher.score(batches[i]) if run is None else run(teacher, batches[i])
        except Exception as failed:  # noqa: BLE001 - agreed over the job just below, raised on every rank
            error = failed
            for waiting in pending.values():
                waiting.cancel()
        sent = served_contexts(self.teachers, batches)  # digests, compared before the asking rank's scores are shared
        check_collect(agreed_views(error, self.group, collect_view(projected, self.asker, batch, sent=sent)))
        asked = [i for i, is_asked in enumerate(self.asynchronous) if is_asked]
        got.update(self.shared({i: got[i] for i in asked if i in got}))
        if not projected:
            return [got[i] for i in range(len(self.teachers))]
        return [teacher.project(batches[i], got[i]) if self.asynchronous[i] else got[i]
                for i, teacher in enumerate(self.teachers)]

    def shared(self, served: dict[int, Any]) -> dict[int, Any]:
        """The asking rank's asynchronous teachers' results on every rank of its sharing group (as
        tensors, never pickled)."""
        group = self.host.share_group
        if group is None or not distributed() or not any(self.asynchronous):
            return served
        from megatron_rl_patches.teachers.share_tensors import shared_results  # lazy: import cost: torch

        return shared_results(served if self.asks() else None, group)
