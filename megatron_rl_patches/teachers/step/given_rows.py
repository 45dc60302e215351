"""Answers a teacher step is given instead of asking (`TeacherStep.add(batch, scored={i: ...})`: a
rollout's served teacher, slime's carried rows) checked as a served reply is checked
(`served.rows_check`, the one check) before the step reads them: per sample its response rows, K,
dtypes, tensors with data (none on the meta device), log-probabilities (no NaN, none above 0, a
top-k mass of at most 1), ids >= 0 (and within the vocabulary the giver names), and the kind the
teacher returns (a `BatchScores` of top-k rows, or with a head its hidden states [R, H] in its
dtype, finite); and what a served reply holds by construction (`rows_check.held_together_problem`):
each row's ids distinct, the tail formed from the top-k, the actual token's log-prob its own top-k
entry's where it is one of them and at most the tail's where it is none of them.

The shapes are read per sample (no kernel); the values once over a run's rows joined (a step of
many samples is checked in a handful of kernels, not a handful per sample), and per sample only to
name the first wrong one.

An answer that fails is refused, never asked again in its place: its digest said it was this
sample's answer, so it is corrupted data (or data of another teacher), and a step that quietly
asked again would hide the fault that made it. The refusal names the teacher, the sample (its place
in the added part), where the rows came from (`ScoredBefore.origin`) and the rule."""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.served.rows_check import shape_problem, states_problem, values_problem

GIVEN = "scored= of TeacherStep.add()"  # where a given answer came from, unless its ScoredBefore names a place
FIELDS = ("token_log_probs", "topk_ids", "topk_log_probs", "tail_log_probs")
CHUNK_ROWS = 4096  # rows checked at once: temporaries of ~650 KB at K = 20 (larger ones page-fault on every call)


def given_problem(teacher: Any, index: int, runs: list[tuple[int, int, Any]], batch: TeacherBatch,
                  origin: str = GIVEN, vocab_size: int | None = None) -> Exception | None:
    """What is wrong with the answers teacher `index` is given for a part (`runs`: `(lo, hi,
    answer)` of `batch`, its batch of the part; an answer None is asked), None: nothing."""
    head = getattr(teacher, "head", None)
    for lo, hi, answer in runs:
        if answer is None:
            continue
        said = f"TeacherStep.add: teacher {index}'s rows given for samples {lo}..{hi - 1} ({origin})"
        if head is None and not isinstance(answer, BatchScores):
            return TypeError(f"{said} are a {type(answer).__name__}: a served teacher without a head answers a "
                             "BatchScores of top-k rows (hidden states only for a teacher with a head)")
        if head is not None and not isinstance(answer, (list, tuple)):
            return TypeError(f"{said} are a {type(answer).__name__}: a served teacher with a head answers its hidden "
                             "states, one [R, H] tensor per sample")
        if head is None and not all(isinstance(field, (list, tuple)) and len(field) == hi - lo for field in (
                answer.token_log_probs, answer.topk_ids, answer.topk_log_probs, answer.tail_log_probs)):
            return ValueError(f"{said}: a BatchScores whose four fields are not each a list of {hi - lo} tensors "
                              "(one per sample)")
        if head is not None and len(answer) != hi - lo:
            return ValueError(f"{said}: {len(answer)} hidden-state tensors for {hi - lo} samples")
        for offset in range(hi - lo):
            wrong = (states_problem(answer[offset], batch.response_rows(lo + offset), head.hidden_size,
                                    getattr(teacher, "hidden_dtype", None)) if head is not None
                     else rows_shape_problem(answer, offset, batch.response_rows(lo + offset), teacher.top_k))
            if wrong is not None:
                return refusal(teacher, index, lo + offset, batch, origin, wrong)
        if head is None:
            found = rows_values_problem(answer, lo, hi, batch, vocab_size)
            if found is not None:
                return refusal(teacher, index, found[0], batch, origin, found[1])
    return None


def refusal(teacher: Any, index: int, sample: int, batch: TeacherBatch, origin: str, wrong: str) -> ValueError:
    rows = batch.response_rows(sample)
    return ValueError(f"TeacherStep.add: teacher {index}'s rows of sample {sample} ({origin}) are not what the "
                      f"served teacher answers: {wrong} (its {rows} response rows at K = {teacher.top_k} expected): "
                      "give the rows it sent, or none (the step then asks it)")


def rows_shape_problem(answer: BatchScores, offset: int, rows: int, k: int) -> str | None:
    """Sample `offset` of `answer`: no field a teacher without a head sends none of, and its four
    tensors of the reply's shapes and dtypes, with data."""
    extra = [name for name in ("hidden_states", "ids_log_probs", "ids_tail_log_probs")
             if getattr(answer, name) is not None]
    if extra:
        return f"{extra[0]} is not None (a teacher without a head sends none)"
    return shape_problem(answer.token_log_probs[offset], answer.topk_ids[offset], answer.topk_log_probs[offset],
                         answer.tail_log_probs[offset], rows, k)


def rows_values_problem(answer: BatchScores, lo: int, hi: int, batch: TeacherBatch,
                        vocab_size: int | None) -> tuple[int, str] | None:
    """(the first wrong sample of lo..hi, what is wrong) in the values of rows whose shapes are
    right, or None: checked once over the run's rows joined (on one device), then per sample only
    to name the first wrong one."""
    def problem(parts: range) -> str | None:
        token, ids, values, tails = (torch.cat([getattr(answer, name)[offset] for offset in parts]) for name in FIELDS)
        actual = [batch.sequences[lo + offset][batch.response_starts[lo + offset]:] for offset in parts]
        return values_problem(token, ids, values, tails, vocab_size, torch.cat(actual).long())

    devices = {getattr(answer, name)[offset].device for name in FIELDS for offset in range(hi - lo)}
    if len(devices) == 1 and all(problem(part) is None for part in row_chunks(batch, lo, hi)):
        return None
    for offset in range(hi - lo):
        wrong = problem(range(offset, offset + 1))
        if wrong is not None:
            return lo + offset, wrong
    return None


def row_chunks(batch: TeacherBatch, lo: int, hi: int) -> list[range]:
    """lo..hi's samples (offsets from lo) in runs of about `CHUNK_ROWS` response rows."""
    chunks, first, rows = [], 0, 0
    for offset in range(hi - lo):
        rows += batch.response_rows(lo + offset)
        if rows >= CHUNK_ROWS:
            chunks.append(range(first, offset + 1))
            first, rows = offset + 1, 0
    return chunks + ([range(first, hi - lo)] if first < hi - lo else [])
