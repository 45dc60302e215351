"""The teachers' shape contract inside a training step: one teacher's outputs of a step, per sample
on the student's response rows (`TeacherScores`). Framework-free: slime's OPD teachers return it,
and so can any loop's."""
from __future__ import annotations

from dataclasses import dataclass

TYPE_CHECKING = False
if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TeacherScores:
    """One teacher's outputs of a step, per sample on the student's response rows: log P of k
    buckets [R, k] and the log tail [R]. A bucket is one of the step's ids (`ids` None: the
    student's top-k, or the union) or a group of ids: then `ids` / `ids_mask` are the student's ids
    of each bucket [R, k·D], `alive` [R, k] the buckets that exist (chunk starts), `log_ratio` [R]
    the token-level signal (a teacher with another tokenizer)."""

    log_probs: list[torch.Tensor]
    tails: list[torch.Tensor]
    ids: list[torch.Tensor] | None = None
    ids_mask: list[torch.Tensor] | None = None
    alive: list[torch.Tensor] | None = None
    log_ratio: list[torch.Tensor] | None = None
