"""A teacher step's samples handed over in parts (`TeacherStep.add(batch)`, as the rollout finishes
them): each part asked at once, the parts joined in the order added when the step collects.

- `joined_batch`: the parts' batches as one `TeacherBatch` (one part: itself, unchanged);
- `JoinedPending`: an asynchronous teacher's requests of every part as one `Pending` — its
  `result(projected=False)` each part's result joined end to end (a `BatchScores` field by field,
  a head's per-sample hidden states as one list), `cancel()` every part's;
- `joined_results`: that joining, for results already in hand;
- `Ready`: a part's answer already in hand (`add(batch, scored={i: answer})`: scored during the
  rollout), as a `Pending`; `scored_problem` checks such answers;
- `ScoredBefore`: answers given elsewhere for some samples of a part, each with the digest of the
  ids it scored (`ids_digest`); `before_runs` reads those whose digest is that of the teacher's
  batch and leaves the others to be asked, in runs of the part's order (`answer_runs`: any given
  answer as such runs)."""
from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megatron_rl_patches.teachers.asynchronous import Pending
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.contract import BatchScores


def joined_batch(parts: Sequence[TeacherBatch]) -> TeacherBatch:
    """The parts' samples in the order added."""
    if len(parts) == 1:
        return parts[0]
    return TeacherBatch([ids for part in parts for ids in part.sequences],
                        [start for part in parts for start in part.response_starts])


def batch_part(batch: TeacherBatch, lo: int, hi: int) -> TeacherBatch:
    """Samples lo..hi of `batch` (all of them: `batch` itself)."""
    if (lo, hi) == (0, len(batch)):
        return batch
    return TeacherBatch(batch.sequences[lo:hi], batch.response_starts[lo:hi])


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


def ids_digest(ids: torch.Tensor, start: int) -> list[int]:
    """One scored sequence in three ints: its length, its response start, the crc32 of its ids."""
    flat = ids.detach().reshape(-1).to("cpu", torch.int64).contiguous()
    return [int(flat.numel()), int(start), zlib.crc32(flat.numpy().tobytes())]


@dataclasses.dataclass(frozen=True)
class ScoredBefore:
    """A teacher's answers given elsewhere (a rollout's served teacher, asked as each generation
    ended), one entry per sample of the part: `(digest, answer)` — the `ids_digest` of the
    sequence it scored (the sample's ids, or its privileged context's before them) and its answer
    for that one sample (a one-sample `BatchScores`, or a head's states as a one-element list) —
    or None where none was given. The step reads an answer where its digest is that of the
    teacher's own batch of the sample and asks the teacher for the others; an answer it reads must
    hold what the served teacher would have sent (`given_rows`), or the step refuses it naming
    `origin` (where the rows came from: e.g. slime's `train_metadata` field) and, for top-k rows,
    ids past `vocab_size` (the teacher's vocabulary, where the giver knows it; None: ids >= 0)."""

    samples: Sequence[tuple[Sequence[int], Any] | None]
    origin: str = "scored= of TeacherStep.add()"
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.origin, str):
            raise TypeError(f"ScoredBefore(origin=...) must be words naming where the rows came from, got "
                            f"{type(self.origin).__name__}")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                                            or self.vocab_size < 1):
            raise ValueError(f"ScoredBefore(vocab_size={self.vocab_size!r}): the teacher's vocabulary size (a "
                             "positive int) or None")

    def __len__(self) -> int:
        return len(self.samples)


def answer_runs(given: Any, batch: TeacherBatch) -> list[tuple[int, int, Any]]:
    """What `add(scored={i: given})` gives teacher i for the part, in runs `(lo, hi, answer)` of
    `batch` (its batch of the part): a whole answer one run; a `ScoredBefore`'s `before_runs`."""
    if isinstance(given, ScoredBefore):
        return before_runs(given, batch)
    return [(0, len(batch), given)]


def before_runs(before: ScoredBefore, batch: TeacherBatch) -> list[tuple[int, int, Any]]:
    """The part's samples in runs `(lo, hi, answer)`: `answer` the joined answers of a run whose
    digests are `batch`'s (the teacher's batch of the part), None for a run to be asked."""
    usable = [given is not None and list(given[0]) == ids_digest(ids, start)
              for given, ids, start in zip(before.samples, batch.sequences, batch.response_starts)]
    runs, lo = [], 0
    while lo < len(usable):
        hi = lo
        while hi < len(usable) and usable[hi] == usable[lo]:
            hi += 1
        answers = [given[1] for given in before.samples[lo:hi] if given is not None]
        runs.append((lo, hi, joined_results(answers) if usable[lo] else None))
        lo = hi
    return runs


def scored_problem(scored: Any, asynchronous: Sequence[bool], samples: int) -> Exception | None:
    """What is wrong with `add(..., scored=...)` (None: nothing): a mapping from the index of an
    asynchronous teacher to one answer per sample of the part (or a `ScoredBefore` of them)."""
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
        if not isinstance(got, (BatchScores, list, tuple, ScoredBefore)) or len(got) != samples:
            shown = f"{len(got)} samples" if isinstance(got, (BatchScores, list, tuple, ScoredBefore)) \
                else type(got).__name__
            return ValueError(f"{where}: teacher {index}'s answer must be a BatchScores (or a head's states: a list; "
                              f"or a ScoredBefore) of the part's {samples} samples, got {shown}")
        if isinstance(got, ScoredBefore) and \
                not all(given is None or one_sample_before(given) for given in got.samples):
            return TypeError(f"{where}: teacher {index}'s ScoredBefore holds per sample (digest, answer) or None: the "
                             "digest three ints (ids_digest), the answer of that one sample")
    return None


def one_sample_before(given: Any) -> bool:
    """Whether `given` is one sample's `(digest, answer)`: `ids_digest`'s three ints and an answer of
    one sample (a `BatchScores`, or a head's states as a one-element list)."""
    if not isinstance(given, tuple) or len(given) != 2:
        return False
    digest, answer = given
    return isinstance(digest, (list, tuple)) and len(digest) == 3 and \
        all(isinstance(v, int) and not isinstance(v, bool) for v in digest) and \
        isinstance(answer, (BatchScores, list, tuple)) and len(answer) == 1
