"""A served teacher's rows carried with their sample from a rollout to its training ranks (slime's
`MEGATRON_RL_PATCHES_OPD_SCORE_AT=rollout`: `integrations/slime/rollout_scores.py`), framework-free
given the keys:

- at the rollout, `packed(scores, batch)`: one sample's `BatchScores` as the train step reads them
  (its top-k ids as int32, their log-probs and tails as float32: what `step_served.own_topk` makes
  of them, so a carried row and an asked one train alike) and a digest of the ids the teacher
  scored (its length, response start and crc32: the sample's own ids, or its privileged context's
  before them), under the teacher's key (`teacher_key`: a digest of its identity, URLs redacted)
  in the sample's `train_metadata[ROWS]`;
- on the training ranks `take_rows` moves them out of the split's carried keys (`CONTEXTS`) to
  `CARRIED`, and `add_carried(step, batch, contexts, rollout_data)` hands the step's samples to
  the teacher step with their rows (`TeacherStep.add(scored={0: ScoredBefore(...)})`): the step
  reads a row where its digest is that of the batch it would ask the teacher for, and asks for
  the others; each entry read back by `carried_entry` (a malformed one refused naming the sample
  and the field), the rows the step reads checked as a served reply (`teachers.step.given_rows`, ids
  within the student's vocabulary). 8K + 8 bytes a response token (168 at K = 20)."""
from __future__ import annotations

import numbers
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.finite import shown
from megatron_rl_patches.teachers.step.parts import ScoredBefore, ids_digest
from megatron_rl_patches.teachers.teacher_identity import teacher_identity

ROWS = "megatron_rl_patches_teacher_rows"  # the reserved train_metadata key of the carried rows
FIELDS = ("ids", "values", "tails", "token")  # a carried entry's rows, beside its digest
CARRIED = "opd_rollout_rows"  # per sample of a training rank's rollout data: its carried rows (or None)


def teacher_key(teacher: Any, context: str | None) -> str:
    """A served teacher's key among a sample's carried rows: a digest of its identity (replica
    URLs redacted and sorted, engine, top-k, temperature, `context`: its context key, read by the
    key's one reader, `teachers.context.privileged`)."""
    identity = teacher_identity(teacher, context, True, head=False)
    return f"{zlib.crc32(repr(sorted(identity.items())).encode()):08x}"


def packed(scores: BatchScores, batch: TeacherBatch) -> dict[str, Any]:
    """The one sample of `batch` scored (`scores`) as it travels: its digest and rows."""
    return {"digest": ids_digest(batch.sequences[0], batch.response_starts[0]),
            "ids": scores.topk_ids[0].to(torch.int32), "values": scores.topk_log_probs[0].float(),
            "tails": scores.tail_log_probs[0].float(), "token": scores.token_log_probs[0].float()}


def unpacked(rows: Sequence[Mapping[str, Any]]) -> BatchScores:
    """Carried samples' rows as the teacher's `BatchScores` (float64 and int64, as a client gives
    them: the float32 values widened exactly)."""
    return BatchScores([torch.as_tensor(r["token"]).double() for r in rows],
                       [torch.as_tensor(r["ids"]).long() for r in rows],
                       [torch.as_tensor(r["values"]).double() for r in rows],
                       [torch.as_tensor(r["tails"]).double() for r in rows])


def carried_entry(rows: Any, sample: int, key: str) -> tuple[list[int], BatchScores]:
    """One sample's carried entry for the teacher of `key` read back (its digest as three ints, its
    rows as `unpacked` gives them), or a ValueError naming the sample and the train_metadata field
    where it is no entry `packed` writes (a bare library error otherwise: int('a'), a KeyError)."""
    field = f"sample {sample}'s train_metadata[{ROWS!r}][{key!r}]"

    def refused(what: str) -> ValueError:
        return ValueError(f"slime_opd: {field} {what}: it is not what the rollout's hook writes (carried_rows.packed); "
                          "drop the field (the train step then asks the teacher) or let the hook write it")

    if not isinstance(rows, Mapping):
        raise refused(f"is a {type(rows).__name__}, not a mapping of digest, ids, values, tails and token")
    missing = [name for name in ("digest", *FIELDS) if name not in rows]
    if missing:
        raise refused(f"has no {missing[0]!r}")
    digest = rows["digest"]
    if isinstance(digest, (str, bytes)) or not isinstance(digest, Sequence) or len(digest) != 3 or \
            not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in digest):
        raise refused(f"holds a digest {shown(digest)[:60]} that is not three ints (ids_digest)")
    for name in FIELDS:
        try:
            tensor = torch.as_tensor(rows[name])
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise refused(f"holds {name} that are no tensor (a {type(rows[name]).__name__})") from None
        integer = name == "ids"
        if tensor.dtype == torch.bool or tensor.is_complex() or tensor.dtype.is_floating_point == integer:
            raise refused(f"holds {name} of dtype {tensor.dtype} ({'integer ids' if integer else 'floating log-probs'} "
                          "expected)")
    return [int(v) for v in digest], unpacked([rows])


def take_rows(rollout_data: dict) -> None:
    """The carried rows out of the split's per-sample keys (`CONTEXTS`, which then holds the
    privileged contexts alone, or goes where none is left) into `CARRIED`."""
    contexts = rollout_data.get(CONTEXTS)
    if not isinstance(contexts, list) or not any(isinstance(c, dict) and ROWS in c for c in contexts):
        return
    rollout_data[CARRIED] = [c.pop(ROWS, None) if isinstance(c, dict) else None for c in contexts]
    if not any(contexts):
        del rollout_data[CONTEXTS]


def add_carried(step: Any, batch: TeacherBatch, contexts: Any, rollout_data: Mapping) -> bool:
    """The step's samples handed to `step` (a one-teacher `TeacherStep` of a served teacher) with
    the rows carried for them (`ScoredBefore`: the step reads a row where its digest is that of
    the batch it asks the teacher for, with the privileged contexts before each response, and
    asks for the others). False (nothing added) where no row was carried for this teacher: the
    caller sends as before."""
    carried = rollout_data.get(CARRIED)
    if not isinstance(carried, list) or len(carried) != len(batch):
        return False
    key = teacher_key(step.teachers[0], step.keys[0])
    mine = [rows.get(key) if isinstance(rows, Mapping) else None for rows in carried]
    if all(rows is None for rows in mine):
        return False
    try:  # each entry read back as packed wrote it, or refused by name (agreed by the step's next collect)
        given = [None if rows is None else carried_entry(rows, sample, key) for sample, rows in enumerate(mine)]
    except ValueError as error:
        step.refuse(error)
        return True
    # the step checks what it reads as a served reply (teachers.step.given_rows), ids within the student's
    # vocabulary (a rollout's teacher is of the student's tokenizer)
    vocab = step.host.vocab_size
    before = ScoredBefore(given, origin=f"slime's train_metadata[{ROWS!r}], carried from the rollout",
                          vocab_size=vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0
                          else None)
    step.add(batch, contexts=contexts, scored={0: before})
    return True
