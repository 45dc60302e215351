"""A teacher step's samples handed over in parts (`TeacherStep.add(batch)`, as the rollout finishes
them): each part asked at once, the parts joined in the order added when the step collects.

- `joined_batch`: the parts' batches as one `TeacherBatch` (one part: itself, unchanged);
- `JoinedPending`: an asynchronous teacher's requests of every part as one `Pending` — its
  `result(projected=False)` each part's result joined end to end (a `BatchScores` field by field,
  a head's per-sample hidden states as one list), `cancel()` every part's;
- `joined_results`: that joining, for results already in hand."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from megatron_rl_patches.teachers.asynchronous import Pending
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.contract import BatchScores


def joined_batch(parts: Sequence[TeacherBatch]) -> TeacherBatch:
    """The parts' samples in the order added."""
    if len(parts) == 1:
        return parts[0]
    return TeacherBatch([ids for part in parts for ids in part.sequences],
                        [start for part in parts for start in part.response_starts])


def joined_results(results: Sequence[Any]) -> Any:
    """Each part's result (a `BatchScores`, or a list / tuple of per-sample tensors) joined end to
    end; one part: itself. TypeError for parts of different kinds (a teacher that answers one part
    with scores and another with states is broken)."""
    if len(results) == 1:
        return results[0]
    if all(isinstance(result, BatchScores) for result in results):
        fields: dict[str, Any] = {}
        for field in dataclasses.fields(BatchScores):
            values = [getattr(result, field.name) for result in results]
            if all(value is None for value in values):
                fields[field.name] = None
            elif any(value is None for value in values):
                raise TypeError(f"TeacherStep.collect: the teacher's scores of the added parts differ in "
                                f"{field.name} (present in some, None in others): a teacher answers every part alike")
            else:
                fields[field.name] = [one for value in values for one in value]
        return BatchScores(**fields)
    if all(isinstance(result, (list, tuple)) for result in results):
        return [one for result in results for one in result]
    raise TypeError("TeacherStep.collect: the teacher's results of the added parts are of different kinds ("
                    + ", ".join(type(result).__name__ for result in results) + "): a teacher answers every part alike")


class JoinedPending:
    """One asynchronous teacher's requests of every added part, as one `Pending`."""

    def __init__(self, parts: Sequence[Pending]) -> None:
        self.parts = list(parts)

    def result(self, group: object = None, *, projected: bool = True) -> Any:
        if len(self.parts) == 1:
            return self.parts[0].result(group, projected=projected)
        if projected:  # a head's projection runs on the joined batch (TeacherStep asks projected=False)
            raise ValueError("JoinedPending.result: ask projected=False and project the joined batch")
        return joined_results([part.result(group, projected=False) for part in self.parts])

    def cancel(self) -> None:
        for part in self.parts:
            part.cancel()
