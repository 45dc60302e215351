"""A served teacher with another tokenizer than the student's, from what the engine returns for
the teacher's own encoding of a sample (`BatchScores`: per teacher row its top-k ids and their
log-probs, and its own token's log-prob). The token-level signal needs only the teacher's own
tokens' log-probs: exact. A chunk-start bucket sums every teacher id that spells its shared string,
and an engine returns only its own top-k: a bucket is exact where each of its teacher ids is among
the returned top-k (always, when each shared string has one teacher id: the buckets come from the
top-k), and is folded into the tail on both sides where one is not (`folded` counts them): the
divergence is then over a coarser partition, still exact, never an estimate of a missing id."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl_patches.cross_tokenizer.teacher_passes import (
    Buckets,
    TeacherSample,
    chunk_start_buckets,
    teacher_buckets_on_student_rows,
)
from megatron_rl_patches.cross_tokenizer.vocabulary import SharedVocabulary
from megatron_rl_patches.teachers.tails import tail_log_probs


@dataclass(frozen=True)
class ServedBuckets:
    """One sample's chunk-start buckets from a served teacher's top-k: `buckets` (the folded ones
    dead, their ids masked out on both sides), the teacher's log P(bucket) [R_student, k] and log
    tail [R_student] on the student's rows (`teacher_buckets_on_student_rows`), and how many
    buckets were folded into the tail."""

    buckets: Buckets
    log_probs: torch.Tensor
    tails: torch.Tensor
    folded: int


def served_buckets(topk_ids: torch.Tensor, topk_log_probs: torch.Tensor, sample: TeacherSample,
                   shared: SharedVocabulary, k: int) -> ServedBuckets:
    """The buckets at each chunk start from the engine's top-k on the teacher's response rows
    (`topk_ids` / `topk_log_probs` [R_teacher, K], best first, K >= `k`): the shared strings of
    the first `k` ids, each bucket's log-prob the log-sum of its teacher ids' returned values, the
    tail log(1 - sum of the buckets) in float64."""
    if topk_ids.shape != topk_log_probs.shape or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_log_probs {tuple(topk_log_probs.shape)} must be "
                         "one [R_teacher, K] shape")
    if topk_ids.shape[1] < k:
        raise ValueError(f"the engine returned {topk_ids.shape[1]} ids per row and k={k} buckets are asked: ask the "
                         "engine for at least k")
    buckets = chunk_start_buckets(topk_ids[:, :k], sample.alignment, shared)
    rows, width = buckets.teacher_ids.shape
    match = buckets.teacher_ids[:, :, None] == topk_ids[:, None, :]  # [R_t, k·D_t, K]
    found = match.any(-1)
    values = topk_log_probs.to(torch.float64).gather(1, match.to(torch.int8).argmax(-1))
    missing = (buckets.teacher_mask & ~found).reshape(rows, k, -1).any(-1)  # [R_t, k] per teacher row
    s_rows, t_rows = sample.alignment.chunk_starts()
    folded_on_student = torch.zeros_like(buckets.alive)
    folded_on_student[s_rows] = missing[t_rows]
    kept = Buckets(buckets.teacher_ids, _cleared(buckets.teacher_mask, missing),
                   buckets.student_ids, _cleared(buckets.student_mask, folded_on_student),
                   buckets.alive & ~folded_on_student)
    id_log_probs = torch.where(kept.teacher_mask, values, -torch.inf)
    log_probs, tails = teacher_buckets_on_student_rows(id_log_probs, tail_log_probs(id_log_probs), kept,
                                                       sample.alignment)
    return ServedBuckets(kept, log_probs, tails, int((buckets.alive & folded_on_student).sum()))


def _cleared(mask: torch.Tensor, folded: torch.Tensor) -> torch.Tensor:
    """A bucket-slot mask [R, k·D] with every slot of the `folded` buckets [R, k] cleared."""
    rows, k = folded.shape
    return (mask.reshape(rows, k, -1) & ~folded[..., None]).reshape(mask.shape)

