"""A served teacher of another tokenizer whose hidden states go through its head on the trainer
(`ServedTeacher(head=...)` scoring the teacher's own encoding of each sample): the chunk-start
buckets scored exactly from the teacher's whole distribution (`head_buckets`) — every teacher id of
every bucket, where `served_buckets` (an engine's top-k only) folds a bucket whose other ids the
engine did not return. The same buckets as an in-process teacher of that tokenizer: the shared
strings of the teacher's top-k at each chunk start, each bucket the log-sum of all its teacher ids,
the tail the exact mass outside them. The token-level signal is the reply's `token_log_probs` (the
teacher's own tokens), exact with or without a head."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl_patches.cross_tokenizer.teacher_passes import (
    TeacherSample,
    chunk_start_buckets,
    log_ratio,
    teacher_buckets_on_student_rows,
)
from megatron_rl_patches.cross_tokenizer.vocabulary import SharedVocabulary
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.cross_buckets import ServedBuckets
from megatron_rl_patches.teachers.head.teacher_head import TeacherHead
from megatron_rl_patches.teachers.scores import TeacherScores


def cross_batch(samples: Sequence[TeacherSample]) -> TeacherBatch:
    """The teacher's own encodings of the samples (`TeacherSample`s) as the `TeacherBatch` a
    served teacher of that tokenizer scores: each whole sequence, its response's rows."""
    return TeacherBatch([s.tokens.detach().cpu() for s in samples],
                        [s.tokens.numel() - s.response_length for s in samples])


def head_buckets(head: TeacherHead, scores: BatchScores, samples: Sequence[TeacherSample],
                 shared: SharedVocabulary, k: int, *, temperature: float = 1.0,
                 invariant: bool | None = None) -> list[ServedBuckets]:
    """Per sample, the chunk-start buckets of the strings of the teacher's top-`k` (`scores.topk_ids`
    of `ServedTeacher(head=head, top_k >= k)` over `cross_batch(samples)`), every bucket's teacher
    ids scored through `head` at `temperature` (in the mode `invariant`, a plan's: None the
    setting's) from `scores.hidden_states` (one pass of the fused op over every sample's
    chunk-start rows; no [rows, V] tensor): log P(bucket) [R_student, k] and the exact log tail
    [R_student] on the student's rows; nothing folded. Every rank of the head's tensor-parallel
    group calls it with the same scores and samples."""
    check_head_buckets(head, scores, samples, k)
    found = [chunk_start_buckets(ids[:, :k], s.alignment, shared) for ids, s in zip(scores.topk_ids, samples)]
    starts = [s.alignment.chunk_starts()[1] for s in samples]
    assert scores.hidden_states is not None  # check_head_buckets refused it otherwise
    hidden = torch.cat([states.reshape(-1, head.hidden_size)[rows.to(states.device)]
                        for states, rows in zip(scores.hidden_states, starts)])
    ids = torch.cat([b.teacher_ids[rows] for b, rows in zip(found, starts)])
    mask = torch.cat([b.teacher_mask[rows] for b, rows in zip(found, starts)])
    if hidden.shape[0]:  # the same rows on every rank of the head's group
        values, tails = head.log_probs_at(hidden, ids, temperature, ids_mask=mask, invariant=invariant)
        values, tails = values.double().cpu(), tails.double().cpu()
    else:
        values, tails = torch.zeros(0, ids.shape[1], dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    out = []
    for b, s, rows, v, t in zip(found, samples, starts, values.split([len(r) for r in starts]),
                                tails.split([len(r) for r in starts])):
        own = torch.full(b.teacher_ids.shape, -torch.inf, dtype=torch.float64)
        own_tails = torch.zeros(b.teacher_ids.shape[0], dtype=torch.float64)
        own[rows], own_tails[rows] = v, t
        log_probs, on_student = teacher_buckets_on_student_rows(own, own_tails, b, s.alignment)
        out.append(ServedBuckets(b, log_probs, on_student, folded=0))
    return out


def cross_scores(buckets: Sequence[ServedBuckets], own_log_probs: Sequence[torch.Tensor],
                 student_log_probs: Sequence[torch.Tensor], samples: Sequence[TeacherSample],
                 device: torch.device | str | None = None) -> TeacherScores:
    """A step's `TeacherScores` of a teacher of another tokenizer, per sample on the student's
    response rows: the buckets' float32 log-probs, tails, student ids, their mask and the live
    buckets, and the token-level signal (`log_ratio`: the teacher's own tokens' log-probs
    `own_log_probs` [R_teacher] spread over each chunk against the student's `student_log_probs`
    [R_student]); on `device` (the student's log-probs' where None)."""
    fields: dict[str, list[torch.Tensor]] = {key: [] for key in ("values", "tails", "ids", "mask", "alive", "ratio")}
    for served, own, student, sample in zip(buckets, own_log_probs, student_log_probs, samples):
        where = student.device if device is None else device
        b = served.buckets
        fields["ratio"].append(log_ratio(student.float(), own.to(student.device), sample.alignment).to(where))
        for key, value in zip(("values", "tails", "ids", "mask", "alive"),
                              (served.log_probs.float(), served.tails.float(), b.student_ids, b.student_mask,
                               b.alive)):
            fields[key].append(value.to(where))
    return TeacherScores(fields["values"], fields["tails"], ids=fields["ids"], ids_mask=fields["mask"],
                         alive=fields["alive"], log_ratio=fields["ratio"])


def check_head_buckets(head: object, scores: object, samples: Sequence[TeacherSample], k: object) -> None:
    """TypeError / ValueError naming what `head_buckets` cannot take: no head, a reply without
    hidden states (a teacher without `head=`), a sample count, row count or top-k width that does
    not fit."""
    if not isinstance(head, TeacherHead):
        raise TypeError(f"head_buckets(head=...) must be the served teacher's TeacherHead (teacher.head), got "
                        f"{type(head).__name__}")
    if not isinstance(scores, BatchScores) or scores.hidden_states is None:
        raise ValueError("head_buckets(scores=...) must be the BatchScores of a ServedTeacher with a head (their "
                         "hidden_states): an engine's top-k alone folds buckets (teachers.served_buckets)")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"head_buckets(k=...) must be a positive int (the buckets per chunk start), got {k!r}")
    if len(samples) != len(scores):
        raise ValueError(f"head_buckets: {len(samples)} samples but {len(scores)} scored: score cross_batch(samples)")
    for i, (s, ids) in enumerate(zip(samples, scores.topk_ids)):
        rows = s.alignment.teacher_chunk.numel()
        if ids.dim() != 2 or ids.shape[0] != rows or scores.hidden_states[i].shape[0] != rows:
            raise ValueError(f"head_buckets: sample {i} has {rows} teacher response rows but its scores hold "
                             f"{tuple(ids.shape)} top-k ids and {tuple(scores.hidden_states[i].shape)} states: score "
                             "cross_batch(samples), the teacher's own encodings")
        if ids.shape[1] < k:
            raise ValueError(f"head_buckets: sample {i}'s scores hold the teacher's top-{ids.shape[1]} and k={k} "
                             f"buckets are asked: score with ServedTeacher(top_k >= {k})")
