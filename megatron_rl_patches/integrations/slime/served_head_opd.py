"""slime_opd's served teacher with a head (`http://host:port;engine=vllm;head=DIR`): the server (vLLM's
pooling runner) sends the teacher's final hidden states and the trainer projects them through the
output layer of the Hugging Face directory DIR (`teachers.TeacherHead`, sharded over the student's
tensor-parallel group): the teacher's whole distribution at slime's --rollout-temperature, so it
scores any ids (MEGATRON_RL_PATCHES_OPD_IDS_FROM student, union or teacher) at any K, in any place
of the teacher list. Every rank of the last pipeline stage asks the server for the step's samples
(each rank of the head's group projects the same rows: its shard of the vocabulary); the other
stages only join the job's agreement on a failure. Context-parallel ranks cut their zigzag rows.
With `;tokenizer=DIR` too (another tokenizer) each rank of the last stage re-tokenizes the samples
for the teacher and the chunk-start buckets are scored exactly through the head
(`teachers.head_cross_buckets`): no bucket folded."""
# lazy imports: optional dependency megatron-core (and httpx, the extra `served`)
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_rl_patches.integrations.slime.allgather_cp import whole_from_zigzag, zigzag_of_whole
from megatron_rl_patches.integrations.slime.cross_passes import cross_pair, teacher_samples
from megatron_rl_patches.integrations.slime.opd_settings import OpdSettings, Teacher
from megatron_rl_patches.integrations.slime.opd_teachers import OpdTeacher, ScoringStep
from megatron_rl_patches.integrations.slime.served_opd import (
    agree_at_load,
    asking_group,
    batch_of,
    device_of,
    job_group,
)
from megatron_rl_patches.integrations.slime.step_plan import IDS, IDS_MASK, TopkRequest
from megatron_rl_patches.ops.topk import union_ids
from megatron_rl_patches.teachers.agreement import agree_failure
from megatron_rl_patches.teachers.head_cross_buckets import cross_batch, cross_scores, head_buckets
from megatron_rl_patches.teachers.named_vocab import check_named_vocab, named_vocab_size
from megatron_rl_patches.teachers.scores import TeacherScores
from megatron_rl_patches.teachers.tokenizer_probe import STUDENTS, probe_tokenizer

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.cross_tokenizer.teacher import CrossTeacher
    from megatron_rl_patches.teachers.contract import BatchScores
    from megatron_rl_patches.teachers.served import PendingScores, ServedTeacher


class ServedHeadOpdTeacher(OpdTeacher):
    """A teacher at a URL whose hidden states go through its head here (`teacher`: a `ServedTeacher`
    with a head, on the last pipeline stage's ranks; None on the others)."""

    def __init__(self, teacher: ServedTeacher | None, pair: CrossTeacher | None = None, k: int = 0) -> None:
        self.teacher = teacher
        self.pending: PendingScores | None = None
        self.pair, self.k = pair, k  # a teacher of another tokenizer: both tokenizers, the buckets per chunk start
        self.samples: list[Any] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.teacher!r})"

    def begin(self, actor: Any, rollout_data: dict) -> None:
        """The step's samples sent now by every rank of the last stage, before the student's pass."""
        if self.teacher is None:
            self.pending = None
        elif self.pair is None:
            self.pending = self.teacher.submit(batch_of(rollout_data))
        else:  # the teacher's own encoding of each sample
            self.samples = teacher_samples(rollout_data, self.pair)
            self.pending = self.teacher.submit(cross_batch(self.samples))

    def unscored(self) -> None:
        """The step scores no teacher: its requests collected all the same (the job's agreement)."""
        self.collected()

    def collected(self, projected: bool = True) -> BatchScores | list[torch.Tensor] | None:
        """The step's scores through the head on the last stage's ranks (None on the others; with
        `projected=False` the hidden states [R_i, H] as sent: `vocab_opd`); a failure on any rank
        raised on every rank of the job."""
        pending, self.pending = self.pending, None
        if self.teacher is None:
            agree_failure(None, job_group())
            return None
        if pending is None:
            error = RuntimeError("slime_opd: a served teacher's step was not sent before its turn; please report this")
            agree_failure(error, job_group())
        assert pending is not None  # agree_failure raised otherwise
        return pending.result(job_group(), projected=projected)

    def score(self, step: ScoringStep) -> TeacherScores | None:
        if self.pair is not None:  # another tokenizer: its own buckets, not the step's ids
            return self.cross_score(step)
        request = step.ids_request()
        scores = self.collected()
        if scores is None:
            return None
        assert not isinstance(scores, list)  # projected: the head's scores
        data = step.rollout_data
        totals, responses = [int(t) for t in data["total_lengths"]], [int(r) for r in data["response_lengths"]]
        device = device_of(data)
        if request.k is not None and not request.union:  # its own top-k become the step's ids
            ids, values, tails = (zigzag_of_whole([v.to(device) for v in field], totals, responses) for field in
                                  (scores.topk_ids, [v.float() for v in scores.topk_log_probs],
                                   [t.float() for t in scores.tail_log_probs]))
            data[IDS] = ids
            data.pop(IDS_MASK, None)
            return TeacherScores(values, tails)
        ids, mask = self.step_ids(request, data, scores, totals, responses)
        values, tails = self.at_ids(scores, ids, mask)
        values, tails = (zigzag_of_whole([v.float().to(device) for v in field], totals, responses)
                         for field in (values, tails))
        if request.union:  # the union replaces the step's ids: the later teachers score it with its mask
            data[IDS] = zigzag_of_whole([i.to(device) for i in ids], totals, responses)
            data[IDS_MASK] = zigzag_of_whole([m.to(device) for m in mask], totals, responses)  # type: ignore[union-attr]
        return TeacherScores(values, tails)

    def cross_score(self, step: ScoringStep) -> TeacherScores | None:
        """A teacher of another tokenizer: every chunk-start bucket of its own top-k scored through
        the head (each bucket's teacher ids whole), and the token-level signal from its own tokens'
        log-probs — the fields a teacher of another tokenizer gives (None off the last stage)."""
        scores = self.collected()
        if scores is None:
            return None
        assert not isinstance(scores, list)  # projected: the head's scores
        assert self.teacher is not None and self.teacher.head is not None and self.samples is not None
        assert self.pair is not None
        samples, self.samples = self.samples, None
        buckets = head_buckets(self.teacher.head, scores, samples, self.pair.shared, self.k,
                               temperature=self.teacher.temperature)
        return cross_scores(buckets, scores.token_log_probs, step.student_log_probs, samples,
                            device_of(step.rollout_data))

    def step_ids(self, request: TopkRequest, data: dict, scores: BatchScores, totals: list[int],
                 responses: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per sample, the whole response's ids this teacher scores (and their padding mask): the
        step's, or (a union) the step's joined by its own top-k."""
        ids = [i.cpu() for i in whole_from_zigzag(list(data[IDS]), totals, responses)]
        mask = None
        if IDS_MASK in data:
            mask = [m.cpu() for m in whole_from_zigzag(list(data[IDS_MASK]), totals, responses)]
        if request.union:
            joined = [union_ids(given, own.to(given.device)) for given, own in zip(ids, scores.topk_ids)]
            ids, mask = [j[0] for j in joined], [j[1] for j in joined]
        return ids, mask

    def at_ids(self, scores: BatchScores, ids: list[torch.Tensor],
               mask: list[torch.Tensor] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The teacher's log-probs at `ids` [R_i, k] and the exact tails [R_i] of every sample: one
        pass of the head's fused op over all the rows."""
        assert self.teacher is not None and self.teacher.head is not None and scores.hidden_states is not None
        head = self.teacher.head
        rows = [i.shape[0] for i in ids]
        width = ids[0].shape[1] if ids else 0
        hidden = torch.cat([s.reshape(-1, head.hidden_size) for s in scores.hidden_states]) if ids else None
        if hidden is None or not hidden.shape[0]:
            return [torch.zeros(r, width) for r in rows], [torch.zeros(r) for r in rows]
        flat_mask = None if mask is None else torch.cat(mask).bool()
        values, tails = head.log_probs_at(hidden, torch.cat(ids).long(), self.teacher.temperature, ids_mask=flat_mask)
        return list(values.cpu().split(rows)), list(tails.cpu().split(rows))


def head_device() -> torch.device:
    """Where the head's shard lives: the rank's GPU (NCCL's collectives), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_served_head(actor: Any, settings: OpdSettings, teacher: Teacher, student: int | str,
                      where: str) -> ServedHeadOpdTeacher:
    """The teacher of `;head=DIR`: DIR's vocabulary checked against the student's (every rank), its
    head read on the last pipeline stage's ranks (this rank's shard of the student's tensor-parallel
    group, padded as the actor pads its vocabulary), the server asked by the first of them (it
    serves the pooling task at the head's hidden size, its tokenizer is the student's); a failure
    on any rank raised on every rank of the job."""
    from megatron_rl_patches.inference.loading.hf.vocab import check_teacher_vocab
    from megatron_rl_patches.integrations.slime.served_opd import student_tokenizer_of
    from megatron_rl_patches.teachers.head import TeacherHead
    from megatron_rl_patches.teachers.served import ServedTeacher  # lazy: optional dependency httpx

    args = actor.args
    assert teacher.head is not None  # the builder's route for `;head=DIR`
    error: BaseException | None = None
    served = pair = None
    try:
        if teacher.tokenizer is None:  # the student's tokenizer: DIR's vocabulary the student's
            check_teacher_vocab(teacher.head, student)
        _, asks, last = asking_group()
        if last and teacher.tokenizer is not None:  # another tokenizer: the pair read where samples are scored
            pair = cross_pair(args, teacher)
        if last:
            head = TeacherHead.from_hf(teacher.head, tp_group=tp_group(),
                                       make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by",
                                                                            None))
            head = dataclasses.replace(head, weight=head.weight.to(head_device()))
            served = ServedTeacher(teacher.path, str(teacher.engine), top_k=settings.k, head=head,
                                   temperature=rollout_temperature(args))
            if asks:
                served.check()
                if pair is not None:
                    probe_tokenizer(served, pair.tokenizer, where, f"the tokenizer ';tokenizer={teacher.tokenizer}' "
                                                                   "names")
                elif teacher.same_tokenizer:  # the user's word: no tokenizer on the server to probe
                    ids = int(student_tokenizer_of(args, where).get_vocab_size(with_added_tokens=True))
                    check_named_vocab(named_vocab_size(teacher, where), ids, where)
                else:
                    probe_tokenizer(served, student_tokenizer_of(args, where), where, STUDENTS)
    except Exception as failed:  # noqa: BLE001 - agreed over the job, then raised
        error = failed
    agree_at_load(error, where)
    return ServedHeadOpdTeacher(served, pair, settings.k)


def rollout_temperature(args: Any) -> float:
    """slime's --rollout-temperature, which the student's buckets are scored at too (1 when unset)."""
    value = getattr(args, "rollout_temperature", None)
    return 1.0 if value is None else float(value)


def tp_group() -> Any:
    """The student's tensor-parallel group (None without torch.distributed: one process)."""
    if job_group() is None:
        return None
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    return ps.get_tensor_model_parallel_group()
