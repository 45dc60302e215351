"""The two routes a served teacher's scores take, one object each behind the one client
(`ServedTeacher` holds one, chosen when it is built: `served_route`):

- `OwnRows`: the engine's own top-k rows, with their exact tails and the actual token's log-prob,
  as the engine sends them (at temperature 1: an engine scores prompt log-probs at 1 whatever is
  asked);
- `HeadStates`: the final hidden states, projected through the teacher's head on the trainer
  (`TeacherHead`): its whole distribution at any K and temperature, and at ids the caller gives.

Each answers what the client asks of its route: the engine asking one server, the ids a `score`
may give, a step's answers assembled, and what every rank makes of them (`project`)."""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.ops.scoring_plan import VOCAB, ScoringPlan
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.errors import ServedTeacherRefusal
from megatron_rl_patches.teachers.head.teacher_head import TeacherHead
from megatron_rl_patches.teachers.served.engines.names import engine_class
from megatron_rl_patches.teachers.served.engines.protocol import SampleRows, ServedEngine
from megatron_rl_patches.teachers.served.hidden_states import (
    check_given_ids,
    head_scores,
    head_temperature,
    hidden_head,
    states_dtype,
)
from megatron_rl_patches.teachers.served.http import TeacherClient


class OwnRows:
    """The engine's own top-k rows (`plan.top_k` of them per row, at temperature 1; no trainer op
    runs, so a plan asking the invariant mode is refused, never dropped)."""

    head: TeacherHead | None = None
    hidden_dtype: torch.dtype | None = None

    def __init__(self, plan: ScoringPlan, hidden_dtype: object = None) -> None:
        states_dtype(hidden_dtype, None)  # a hidden_dtype without a head: refused, never ignored
        if plan.top_k is VOCAB:
            raise ValueError("ServedTeacher(plan=ScoringPlan(VOCAB)): an engine sends its own top-k log-probs only; "
                             "the whole vocabulary needs the teacher's hidden states through its head (head=DIR)")
        if plan.temperature != 1.0:
            raise ValueError(f"ServedTeacher(temperature={plan.temperature!r}): served engines score prompt log-probs "
                             f"at temperature 1 whatever is asked, so only temperature=1.0 can be served (score at "
                             f"the student's temperature 1, or use an in-process teacher)")
        if plan.invariant is True:
            raise ValueError("ServedTeacher(plan=ScoringPlan(..., invariant=True)): an engine computes its own top-k "
                             "rows, in its own mode, and the invariant mode is the trainer's vocabulary ops': serve "
                             "hidden states and give the teacher its head (head=DIR), or plan invariant=None / False")
        self.plan = plan

    def engine(self, name: str, client: TeacherClient, model: str | None) -> ServedEngine:
        return engine_class(name)(client, self.plan.k, model)

    def given_ids(self, batch: TeacherBatch, ids: object, url: str) -> None:
        if ids is not None:
            raise ServedTeacherRefusal("ServedTeacher.score(ids=...) needs a head (ServedTeacher(head=...)): an "
                                       "engine's prompt log-probs hold only the teacher's own top-k", url)

    def answered(self, batch: TeacherBatch, answers: dict[int, SampleRows]) -> BatchScores:
        """Every sample's rows as the engine sent them (a sample of no rows: empty ones)."""
        rows = [answers[i] if i in answers else empty_rows(self.plan.k) for i in range(len(batch))]
        return BatchScores([r.token_log_probs for r in rows], [r.topk_ids for r in rows],
                           [r.topk_log_probs for r in rows], [r.tail_log_probs for r in rows])

    def project(self, batch: TeacherBatch, got: Any, ids: list[torch.Tensor] | None = None) -> BatchScores:
        """The scores as they came."""
        return got

    def recut(self, head: TeacherHead) -> OwnRows:
        raise TypeError("ServedTeacher.head: a teacher whose engine sends its own rows takes no head (build it with "
                        "head=DIR against a pooling server)")


class HeadStates:
    """The final hidden states (in `hidden_dtype`) through `head` on the trainer, at the plan's K,
    temperature and invariant mode."""

    def __init__(self, head: TeacherHead, plan: ScoringPlan, hidden_dtype: object = None) -> None:
        head_temperature(plan.temperature, plan.top_k, head)  # the trainer forms the distribution: any K, any τ
        self.head, self.plan = head, plan
        self.hidden_dtype = states_dtype(hidden_dtype, head)

    def engine(self, name: str, client: TeacherClient, model: str | None) -> ServedEngine:
        return engine_class(name, states=True)(client, 0 if self.plan.top_k is VOCAB else self.plan.k, model,
                                               self.head.hidden_size, self.hidden_dtype, self.head.source,
                                               self.head.fingerprint)

    def given_ids(self, batch: TeacherBatch, ids: object, url: str) -> list[torch.Tensor] | None:
        """Every sample's ids within the head's vocabulary, and `ids` of `score` checked."""
        for i, sequence in enumerate(batch.sequences):
            if len(sequence) and int(sequence.max()) >= self.head.vocab_size:
                raise ServedTeacherRefusal(f"sample {i} holds id {int(sequence.max())}, outside the teacher head's "
                                           f"vocabulary of {self.head.vocab_size}", url, i)
        return check_given_ids(ids, batch, self.head.vocab_size)

    def answered(self, batch: TeacherBatch, answers: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Every sample's hidden states [R_i, H] as the server sent them (a sample of no rows: [0, H])."""
        no_rows = torch.zeros(0, self.head.hidden_size, dtype=self.hidden_dtype)
        return [answers[i] if i in answers else no_rows for i in range(len(batch))]

    def project(self, batch: TeacherBatch, got: Any, ids: list[torch.Tensor] | None = None) -> BatchScores:
        """The states through the head (with `ids`, scored at them too): the head's ops, alike on
        every rank of its group."""
        return head_scores(self.head, batch, got, self.plan, ids)

    def recut(self, head: TeacherHead) -> HeadStates:
        """This route through `head`, the same checkpoint's output layer cut for the host (the states,
        their dtype and the engines asking for them unchanged)."""
        if head.hidden_size != self.head.hidden_size:
            raise ValueError(f"ServedTeacher.head: a head of width {head.hidden_size} for states of "
                             f"{self.head.hidden_size}: re-cut the teacher's own head")
        return HeadStates(head, self.plan, self.hidden_dtype)


Route = OwnRows | HeadStates


def served_route(head: object, engine: object, plan: ScoringPlan, hidden_dtype: object = None) -> Route:
    """`ServedTeacher(head=...)`'s route: through the head where one is given (a `TeacherHead` or
    its checkpoint's directory, read whole on this rank), else the engine's own rows."""
    teacher_head = hidden_head(head, engine)
    return OwnRows(plan, hidden_dtype) if teacher_head is None else HeadStates(teacher_head, plan, hidden_dtype)


def empty_rows(k: int) -> SampleRows:
    """A sample with no response rows."""
    values = torch.zeros(0, k, dtype=torch.float64)
    return SampleRows(torch.zeros(0, dtype=torch.float64), torch.zeros(0, k, dtype=torch.int64), values,
                      torch.zeros(0, dtype=torch.float64))
