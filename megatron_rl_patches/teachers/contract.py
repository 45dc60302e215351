"""The framework-free teacher contract: a teacher scores a `TeacherBatch` into `BatchScores`, per
sample on the response rows — the top-k buckets it chose, their exact tail, and the log-prob of
each actual token. Any kind of teacher (served, in-process) that keeps it serves every loop."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from megatron_rl_patches.ops.scoring_plan import ScoringPlan

TYPE_CHECKING = False
if TYPE_CHECKING:
    import torch

    from megatron_rl_patches.teachers.batch import TeacherBatch


@dataclass(frozen=True)
class BatchScores:
    """Per sample i, on its R_i response rows (row r scores the token at response_start + r given
    every token before it): `token_log_probs` [R_i], the teacher's own top-k `topk_ids` [R_i, K]
    (int64) and `topk_log_probs` [R_i, K] (best first), and `tail_log_probs` [R_i] =
    log(1 - sum_k p) — float64, at temperature 1 (a teacher with its head on the trainer: at the
    temperature asked, the tail the exact mass outside the top-k). A hidden-state teacher
    (`ServedTeacher(head=...)`) also returns `hidden_states` [R_i, H] (row r: the state that
    predicts token response_start + r, as the server sent it) and, where `score(batch, ids=...)`
    gave ids [R_i, k], `ids_log_probs` [R_i, k] at them and `ids_tail_log_probs` [R_i] (the
    mass outside them); None otherwise."""

    token_log_probs: list[torch.Tensor]
    topk_ids: list[torch.Tensor]
    topk_log_probs: list[torch.Tensor]
    tail_log_probs: list[torch.Tensor]
    hidden_states: list[torch.Tensor] | None = None
    ids_log_probs: list[torch.Tensor] | None = None
    ids_tail_log_probs: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.token_log_probs)


class BatchTeacher(Protocol):
    """A teacher that scores whole samples: `top_k` buckets per row, chosen by the teacher, at the
    `ScoringPlan` it was built with (`plan`; a teacher without one scores its `top_k` at temperature
    1: `teacher_plan`)."""

    top_k: int

    def score(self, batch: TeacherBatch) -> BatchScores:
        """Every sample of `batch` scored on its response rows."""
        ...


def teacher_plan(teacher: Any) -> ScoringPlan:
    """The `ScoringPlan` `teacher` scores at: the one it was built with (`teacher.plan`: the
    package's teachers), else the contract's short form, its `top_k` at temperature 1."""
    plan = getattr(teacher, "plan", None)
    return plan if isinstance(plan, ScoringPlan) else ScoringPlan(teacher.top_k)
