"""slime_opd's served teacher with another tokenizer (`http://host:port;engine=vllm;tokenizer=DIR`):
the server scores the teacher's own encoding of each sample (re-tokenized on the asking rank), and
its reply gives the two terms of a teacher with another tokenizer (`cross_passes`): the token-level
signal from its own tokens' log-probs (exact), and the chunk-start buckets from its top-k
(`teachers.cross_buckets`: exact where every teacher id of a bucket came back, else the bucket is
folded into the tail on both sides). Asking, sharing and agreeing failures as `served_opd`'s."""
# lazy imports: optional dependency megatron-core (and httpx, the extra `served`)
from __future__ import annotations

import logging
from typing import Any

import torch

from megatron_rl_patches.cross_tokenizer import teacher_passes as ct
from megatron_rl_patches.cross_tokenizer.teacher import CrossTeacher
from megatron_rl_patches.integrations.slime.cross_passes import cross_pair, teacher_samples
from megatron_rl_patches.integrations.slime.opd_settings import OpdSettings, Teacher
from megatron_rl_patches.integrations.slime.opd_teachers import ScoringStep
from megatron_rl_patches.integrations.slime.served_opd import ServedOpdTeacher, connect, device_of
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.cross_buckets import served_buckets
from megatron_rl_patches.teachers.scores import TeacherScores

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.teachers.contract import BatchScores
    from megatron_rl_patches.teachers.served import ServedTeacher

LOG = logging.getLogger(__name__)


class ServedCrossOpdTeacher(ServedOpdTeacher):
    """A served teacher of another tokenizer (`pair`: both tokenizers and their shared vocabulary,
    read on the asking rank only): per sample and whole, its bucket scores [R, k] and tails [R] on
    the student's rows, the student's bucket ids [R, k·D] and mask, the live buckets and the
    log-ratio [R] — the fields `cross_passes.place` stores."""

    def __init__(self, teacher: ServedTeacher, pair: CrossTeacher | None, k: int) -> None:
        super().__init__(teacher, student_vocab=0)
        self.pair, self.k = pair, k
        self.samples: list[ct.TeacherSample] | None = None

    def batch(self, rollout_data: dict) -> TeacherBatch:
        assert self.pair is not None  # read by the asking rank, the one that builds batches
        self.samples = teacher_samples(rollout_data, self.pair)
        return TeacherBatch([s.tokens.detach().cpu() for s in self.samples],
                            [s.tokens.numel() - s.response_length for s in self.samples])

    def rows(self, scores: BatchScores) -> Any:
        """Per sample: the buckets' values on the student's rows, the student's bucket ids, their
        mask and the live buckets, the teacher's own tokens' log-probs and the alignment."""
        samples, self.samples = self.samples, None
        assert self.pair is not None and samples is not None  # the asking rank's, from `batch`
        out, folded = [], 0
        for sample, ids, values, own in zip(samples, scores.topk_ids, scores.topk_log_probs,
                                            scores.token_log_probs):
            served = served_buckets(ids, values, sample, self.pair.shared, self.k)
            folded += served.folded
            b = served.buckets
            out.append((served.log_probs.float(), served.tails.float(), b.student_ids.cpu(), b.student_mask.cpu(),
                        b.alive.cpu(), own.float().cpu(), sample.alignment))
        if folded:
            LOG.info("slime_opd: %s: %d chunk-start bucket(s) held a teacher id outside the engine's top-%d and "
                     "were folded into the tail", self.teacher.url, folded, self.k)
        return out

    def score(self, step: ScoringStep) -> TeacherScores | None:
        rows = self.shared_rows()
        if rows is None:
            return None
        device = device_of(step.rollout_data)
        fields: dict[str, list[torch.Tensor]] = {key: [] for key in ("values", "tails", "ids", "mask", "alive",
                                                                     "ratio")}
        for (values, tails, ids, mask, alive, own, alignment), student in zip(rows, step.student_log_probs):
            fields["ratio"].append(ct.log_ratio(student.float(), own.to(student.device), alignment))
            for key, value in zip(("values", "tails", "ids", "mask", "alive"), (values, tails, ids, mask, alive)):
                fields[key].append(value.to(device))
        return TeacherScores(fields["values"], fields["tails"], ids=fields["ids"], ids_mask=fields["mask"],
                             alive=fields["alive"], log_ratio=fields["ratio"])


def build_served_cross(args: Any, settings: OpdSettings, teacher: Teacher, where: str) -> ServedCrossOpdTeacher:
    """The served teacher of `teacher` (`;tokenizer=DIR`): the server checked to share that
    tokenizer, the pair read by the rank that asks it."""
    pairs: list[CrossTeacher] = []

    def teachers_tokenizer() -> tuple[Any, str]:
        pairs.append(cross_pair(args, teacher))
        return pairs[0].tokenizer, f"the tokenizer ';tokenizer={teacher.tokenizer}' names"

    served = connect(args, settings, teacher.path, str(teacher.engine), where, teachers_tokenizer)
    return ServedCrossOpdTeacher(served, pairs[0] if pairs else None, settings.k)
