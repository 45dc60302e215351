"""A teacher step's samples handed over in parts (`TeacherStep.add(batch)`, as the rollout finishes
them): each part asked at once, the parts joined in the order added when the step collects.

- `joined_batch`: the parts' batches as one `TeacherBatch` (one part: itself, unchanged);
- `JoinedPending`: an asynchronous teacher's requests of every part as one `Pending` — its
  `result(projected=False)` each part's result joined end to end (a `BatchScores` field by field,
  a head's per-sample hidden states as one list), `cancel()` every part's;
- `joined_results`: that joining, for results already in hand;
- `Ready`: a part's answer already in hand (`add(batch, scored={i: answer})`: scored during the
  rollout), as a `Pending`; `scored_problem` checks such answers."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
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


class Ready:
    """An answer already in hand, as a `Pending` (nothing in flight, nothing to cancel)."""

    def __init__(self, got: Any) -> None:
        self.got = got

    def result(self, group: object = None, *, projected: bool = True) -> Any:
        return self.got

    def cancel(self) -> None:
        pass


def scored_problem(scored: Any, asynchronous: Sequence[bool], samples: int) -> Exception | None:
    """What is wrong with `add(..., scored=...)` (None: nothing): a mapping from the index of an
    asynchronous teacher to one answer per sample of the part."""
    if scored is None:
        return None
    where = "TeacherStep.add(scored=...)"
    if not isinstance(scored, Mapping):
        return TypeError(f"{where} must map a teacher's index to its answer for the part, got {type(scored).__name__}")
    for index, got in scored.items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(asynchronous) \
                or not asynchronous[index]:
            return ValueError(f"{where}: key {index!r} is not the index of one of the step's asynchronous (served) "
                              "teachers: an in-process teacher scores the joined batch in collect()")
        if not isinstance(got, (BatchScores, list, tuple)) or len(got) != samples:
            shown = f"{len(got)} samples" if isinstance(got, (BatchScores, list, tuple)) else type(got).__name__
            return ValueError(f"{where}: teacher {index}'s answer must be a BatchScores (or a head's states: a list) "
                              f"of the part's {samples} samples, got {shown}")
    return None
