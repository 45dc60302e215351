"""slime_opd's teacher served by an inference engine (`ServedOpdTeacher`, the entry
`http://host:port;engine=vllm`): a `ServedTeacher` asked for its own top-k with the exact tail.
A step's samples are sent before the student's pass (`begin`: the client's threads carry them
while the student's forward runs) and collected in the teacher's turn (`score`). Each sample is
asked once per data-parallel rank, by the first rank of the last pipeline stage's tensor and
context-parallel group, which hands the rows to the rest of that group; context-parallel ranks
cut their zigzag rows. A failure on any rank is the same error on every rank of the job. The
engine scores only its own top-k: the buckets come from it (MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher,
the served teacher first), the student and the other teachers score them."""
# lazy imports: optional dependency megatron-core (and httpx, the extra `served`)
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.integrations.slime.allgather_cp import zigzag_of_whole
from megatron_rl_patches.integrations.slime.opd_settings import OpdSettings
from megatron_rl_patches.integrations.slime.opd_teachers import OpdTeacher, ScoringStep
from megatron_rl_patches.integrations.slime.step_plan import IDS, IDS_MASK
from megatron_rl_patches.teachers.agreement import agree_failure
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.errors import ServedTeacherRefusal
from megatron_rl_patches.teachers.named_vocab import check_named_vocab
from megatron_rl_patches.teachers.scores import TeacherScores
from megatron_rl_patches.teachers.tokenizer_probe import STUDENTS, probe_tokenizer

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.teachers.contract import BatchScores
    from megatron_rl_patches.teachers.served import PendingScores, ServedTeacher



def job_group() -> Any:
    """The job's group (None without torch.distributed: one process)."""
    dist = torch.distributed
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def asking_group() -> tuple[Any, bool, bool]:
    """(this rank's tensor and context-parallel group or None, whether this rank asks the server,
    whether it holds the last pipeline stage): the group's first rank on the last stage asks."""
    if job_group() is None:
        return None, True, True
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    last = ps.get_pipeline_model_parallel_world_size() == 1 or ps.is_pipeline_last_stage(ignore_virtual=True)
    group = ps.get_tensor_and_context_parallel_group()
    return group, last and torch.distributed.get_rank(group) == 0, last


class ServedOpdTeacher(OpdTeacher):
    """A teacher at a URL (`ServedTeacher`): its own top-k [R, k], their log-probs and the exact
    tail per sample; as the first teacher its ids become the step's (the others score them)."""

    def __init__(self, teacher: ServedTeacher, student_vocab: int) -> None:
        self.teacher = teacher
        self.student_vocab = student_vocab
        self.pending: PendingScores | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.teacher!r})"

    def batch(self, rollout_data: dict) -> TeacherBatch:
        """The step's samples as the server scores them (on the asking rank)."""
        return batch_of(rollout_data)

    def begin(self, actor: Any, rollout_data: dict) -> None:
        """The step's samples sent now (on the asking rank), before the student's pass."""
        _, asks, _ = asking_group()
        self.pending = self.teacher.submit(self.batch(rollout_data)) if asks else None

    def unscored(self) -> None:
        """The step scores no teacher: its requests collected all the same, so the job's agreement
        on them (`agree_failure`) is joined by this rank too."""
        self.shared_rows()

    def score(self, step: ScoringStep) -> TeacherScores | None:
        request = step.ids_request()
        if request.k is None:  # check_served refused it before anything loaded
            raise RuntimeError("slime_opd: a served teacher is not the first; please report this")
        rows = self.shared_rows()
        if rows is None:
            return None
        data = step.rollout_data
        totals, responses = [int(t) for t in data["total_lengths"]], [int(r) for r in data["response_lengths"]]
        ids, values, tails = (zigzag_of_whole([v.to(device_of(data)) for v in field], totals, responses)
                              for field in rows)
        data[IDS] = ids
        data.pop(IDS_MASK, None)
        return TeacherScores(values, tails)

    def rows(self, scores: BatchScores) -> Any:
        """What the asking rank hands its group from the engine's reply: per sample the top-k ids,
        their float32 log-probs and tails."""
        self.check_ids(scores)
        return ([i.cpu() for i in scores.topk_ids], [v.float().cpu() for v in scores.topk_log_probs],
                [t.float().cpu() for t in scores.tail_log_probs])

    def shared_rows(self) -> Any:
        """The asking rank's `rows`, on every rank of the last stage's tensor and context group
        (None on the other stages); a failure anywhere raised on every rank of the job."""
        group, asks, last = asking_group()
        rows = self._collect(asks)
        if not last:
            return None
        if group is not None and torch.distributed.get_world_size(group) > 1:
            shared = [rows]
            torch.distributed.broadcast_object_list(shared, src=torch.distributed.get_global_rank(group, 0),
                                                    group=group)
            rows = shared[0]
        assert rows is not None  # the asking rank's rows, agreed and shared
        return rows

    def _collect(self, asks: bool) -> Any:
        pending, self.pending = self.pending, None
        error: BaseException | None = None
        rows = None
        if asks:
            try:
                if pending is None:
                    raise RuntimeError("slime_opd: a served teacher's step was not sent before its turn; please "
                                       "report this")
                rows = self.rows(pending.result())
            except Exception as failed:  # noqa: BLE001 - agreed over the job, then raised
                error = failed
        agree_failure(error, job_group())
        return rows

    def check_ids(self, scores: BatchScores) -> None:
        for sample, ids in enumerate(scores.topk_ids):
            if ids.numel() and int(ids.max()) >= self.student_vocab:
                raise ServedTeacherRefusal(f"{self.teacher.url} (sample {sample}): the served teacher's top-k holds "
                                           f"id {int(ids.max())}, past the student's vocabulary of "
                                           f"{self.student_vocab}: serve a teacher of the student's tokenizer",
                                           self.teacher.url, sample)


def device_of(rollout_data: dict) -> torch.device:
    """The device of the rollout's tokens (the CPU for an empty rollout)."""
    return rollout_data["tokens"][0].device if len(rollout_data["tokens"]) else torch.device("cpu")


def batch_of(rollout_data: dict) -> TeacherBatch:
    """slime's rollout samples (prompt + response ids) as a `TeacherBatch` of their responses."""
    tokens = list(rollout_data["tokens"])
    responses = [int(r) for r in rollout_data["response_lengths"]][: len(tokens)]
    return TeacherBatch([t.detach().cpu() for t in tokens], [len(t) - r for t, r in zip(tokens, responses)])


def student_tokenizer_of(args: Any, where: str) -> Any:
    """The student's tokenizer (slime's --hf-checkpoint), which the served model's is probed against."""
    from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer  # lazy: optional dependency tokenizers

    hf = getattr(args, "hf_checkpoint", None)
    if not isinstance(hf, str):
        raise ValueError(f"{where}: a served teacher's tokenizer is checked against the student's: set slime's "
                         "--hf-checkpoint to the student's Hugging Face directory (its tokenizer.json)")
    return load_tokenizer(hf, "--hf-checkpoint")


def connect(args: Any, settings: OpdSettings, url: str, engine: str, where: str,
            tokenizer: Callable[[], tuple[Any, str]] | None = None, named_vocab: int | None = None) -> ServedTeacher:
    """The teacher at `url` (its own top-k, K = the settings' k), checked by the ranks that will ask
    it (the server answers, K within its --max-logprobs, its tokenizer: `tokenizer()` gives the one
    it must share and whose it is, the student's by default; with `named_vocab`, the entry's
    `;same_tokenizer`, not probed: the student's tokenizer's ids within that vocabulary); a failure
    on any rank raised on every rank of the job."""
    from megatron_rl_patches.teachers.served import ServedTeacher  # lazy: optional dependency httpx

    error: BaseException | None = None
    teacher = None
    try:
        teacher = ServedTeacher(url, engine, top_k=settings.k)
        if asking_group()[1]:
            teacher.check()
            if named_vocab is not None:  # the user's word: no tokenizer on the server to probe
                ids = int(student_tokenizer_of(args, where).get_vocab_size(with_added_tokens=True))
                check_named_vocab(named_vocab, ids, where)
            else:
                expected, whose = (student_tokenizer_of(args, where), STUDENTS) if tokenizer is None else tokenizer()
                probe_tokenizer(teacher, expected, where, whose)
    except Exception as failed:  # noqa: BLE001 - agreed over the job, then raised
        error = failed
    agree_at_load(error, where)
    assert teacher is not None  # no error: built
    return teacher


def agree_at_load(error: BaseException | None, where: str) -> None:
    """A failure of a served teacher's load on any rank (`error` here) raised on every rank of the
    job as a ValueError naming the entry (`where`)."""
    try:
        agree_failure(error, job_group())
    except Exception as agreed:
        raise ValueError(f"{where}: {agreed}") from agreed


def build_served(args: Any, settings: OpdSettings, url: str, engine: str, student_vocab: int,
                 where: str, named_vocab: int | None = None) -> ServedOpdTeacher:
    """The teacher at `url` of the student's tokenizer (`connect`; `named_vocab`: the entry's
    `;same_tokenizer` vocabulary, for a server without a tokenizer to probe)."""
    return ServedOpdTeacher(connect(args, settings, url, engine, where, named_vocab=named_vocab), student_vocab)
