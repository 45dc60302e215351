"""What a training step takes from a served teacher's `BatchScores` (the teacher step's result:
the same on every rank of a sharing group), per sample on its whole response rows, framework-free
(a framework's wrapper cuts and places the rows):

- `OwnTopkServed`: a teacher of the student's tokenizer scoring its own top-k — they become the
  step's ids (their float32 log-probs and exact tails beside them);
- `CrossServed`: a teacher of another tokenizer — the chunk-start buckets of its top-k on the
  student's rows (`served_buckets`; with a head every bucket exact, `head_buckets`), and the
  token-level log-ratio against the student;
- `HeadServed`: a teacher whose hidden states go through its head here (`ServedTeacher(head=...)`)
  — its own top-k, or its log-probs at any ids (the student's, or their union with its own)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megatron_rl_patches.ops.topk import union_ids
from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.cross_buckets import served_buckets
from megatron_rl_patches.teachers.errors import ServedTeacherRefusal
from megatron_rl_patches.teachers.head.cross_buckets import cross_scores, head_buckets
from megatron_rl_patches.teachers.scores import TeacherScores

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.cross_tokenizer.teacher import CrossTeacher
    from megatron_rl_patches.cross_tokenizer.teacher_passes import TeacherSample
    from megatron_rl_patches.teachers.served.client import ServedTeacher

LOG = logging.getLogger(__name__)
Rows = list[torch.Tensor]


def own_topk(scores: BatchScores) -> tuple[Rows, Rows, Rows]:
    """Per sample the teacher's own top-k ids, their float32 log-probs and float32 tails (CPU)."""
    return ([i.cpu() for i in scores.topk_ids], [v.float().cpu() for v in scores.topk_log_probs],
            [t.float().cpu() for t in scores.tail_log_probs])


@dataclass
class OwnTopkServed:
    """A served teacher of the student's tokenizer: its own top-k are the step's ids, each within
    the student's vocabulary (`student_vocab`) or refused naming the sample."""

    teacher: ServedTeacher
    student_vocab: int

    def rows(self, scores: BatchScores) -> tuple[Rows, Rows, Rows]:
        for sample, ids in enumerate(scores.topk_ids):
            if ids.numel() and int(ids.min()) < 0:  # the client refuses one; rows given to the step are checked too
                raise ServedTeacherRefusal(f"{self.teacher.url} (sample {sample}): the served teacher's top-k holds "
                                           f"a negative id ({int(ids.min())}): ids are vocabulary indices",
                                           self.teacher.url, sample)
            if ids.numel() and int(ids.max()) >= self.student_vocab:
                raise ServedTeacherRefusal(f"{self.teacher.url} (sample {sample}): the served teacher's top-k holds "
                                           f"id {int(ids.max())}, past the student's vocabulary of "
                                           f"{self.student_vocab}: serve a teacher of the student's tokenizer",
                                           self.teacher.url, sample)
        return own_topk(scores)


@dataclass
class CrossServed:
    """A served teacher of another tokenizer (`pair`: both tokenizers and their shared vocabulary;
    `k` buckets per chunk start): it scores its own encoding of each sample
    (`head_cross_buckets.cross_batch`); with a head every bucket exactly (`head_buckets`), else
    the engine's top-k (`served_buckets`: a bucket holding an id outside them folded into the
    tail)."""

    teacher: ServedTeacher
    pair: CrossTeacher
    k: int

    def scores(self, scores: BatchScores, samples: list[TeacherSample], student_log_probs: Rows,
               device: torch.device) -> TeacherScores:
        """Per sample on the student's whole response rows: the buckets' values [R, k] and tails
        [R], the student's bucket ids [R, k·D] with their mask, the live buckets [R, k] and the
        log-ratio [R] against `student_log_probs` (on `device`)."""
        head = self.teacher.head
        if head is not None:
            buckets = head_buckets(head, scores, samples, self.pair.shared, self.k,
                                   temperature=self.teacher.temperature, invariant=self.teacher.invariant)
            return cross_scores(buckets, scores.token_log_probs, student_log_probs, samples, device)
        buckets = [served_buckets(ids, values, sample, self.pair.shared, self.k)
                   for sample, ids, values in zip(samples, scores.topk_ids, scores.topk_log_probs)]
        folded = sum(b.folded for b in buckets)
        if folded:
            LOG.info("served teacher %s: %d chunk-start bucket(s) held a teacher id outside the engine's top-%d and "
                     "were folded into the tail", self.teacher.url, folded, self.k)
        # the engine's own tokens' log-probs as float32 (as the served rows always carried them)
        return cross_scores(buckets, [own.float() for own in scores.token_log_probs], student_log_probs, samples,
                            device)


@dataclass
class HeadServed:
    """A served teacher with its head on the trainer (`teacher.head`): its whole distribution at
    its temperature, so it scores its own top-k (`own_topk`) or any ids (`at_ids`)."""

    teacher: ServedTeacher

    @staticmethod
    def joined(ids: Rows, mask: Rows | None, scores: BatchScores, union: bool) -> tuple[Rows, Rows | None]:
        """The ids it scores per sample (and their padding mask): `ids`, or (a union) `ids` joined
        by its own top-k."""
        if not union:
            return ids, mask
        joined = [union_ids(given, own.to(given.device)) for given, own in zip(ids, scores.topk_ids)]
        return [j[0] for j in joined], [j[1] for j in joined]

    def at_ids(self, scores: BatchScores, ids: Rows, mask: Rows | None) -> tuple[Rows, Rows]:
        """Its log-probs at `ids` [R_i, k] and the exact tails [R_i] of every sample: one pass of
        the head's fused op over all the rows."""
        head = self.teacher.head
        assert head is not None and scores.hidden_states is not None  # a head teacher's scores hold the states
        rows = [i.shape[0] for i in ids]
        width = ids[0].shape[1] if ids else 0
        hidden = torch.cat([s.reshape(-1, head.hidden_size) for s in scores.hidden_states]) if ids else None
        if hidden is None or not hidden.shape[0]:
            return [torch.zeros(r, width) for r in rows], [torch.zeros(r) for r in rows]
        flat_mask = None if mask is None else torch.cat(mask).bool()
        values, tails = head.log_probs_at(hidden, torch.cat(ids).long(), self.teacher.temperature, ids_mask=flat_mask,
                                          invariant=self.teacher.invariant)
        return [v.float() for v in values.cpu().split(rows)], [t.float() for t in tails.cpu().split(rows)]
