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

import threading
from typing import Any

import torch

from megatron_rl_patches.integrations.slime.allgather_cp import zigzag_of_whole
from megatron_rl_patches.integrations.slime.opd_settings import OpdSettings
from megatron_rl_patches.integrations.slime.opd_teachers import OpdTeacher, ScoringStep
from megatron_rl_patches.integrations.slime.step_plan import IDS, IDS_MASK
from megatron_rl_patches.teachers.agreement import agree_failure
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.errors import ServedTeacherRefusal
from megatron_rl_patches.teachers.scores import TeacherScores

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.teachers.contract import BatchScores
    from megatron_rl_patches.teachers.served import PendingScores, ServedTeacher

# A text spelled by the student's tokenizer from ids spread over its vocabulary, tokenized again by
# the server: the same ids back means the same tokenizer (an offset or another vocabulary differs).
PROBE_IDS = 24


def _world() -> Any:
    """The job's group (None without torch.distributed: one process)."""
    dist = torch.distributed
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _asking_group() -> tuple[Any, bool, bool]:
    """(this rank's tensor and context-parallel group or None, whether this rank asks the server,
    whether it holds the last pipeline stage): the group's first rank on the last stage asks."""
    if _world() is None:
        return None, True, True
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    last = ps.get_pipeline_model_parallel_world_size() == 1 or ps.is_pipeline_last_stage(ignore_virtual=True)
    group = ps.get_tensor_and_context_parallel_group()
    return group, last and torch.distributed.get_rank(group) == 0, last


def probe_vocabulary(teacher: ServedTeacher, student_tokenizer: Any, where: str) -> None:
    """The served model's tokenizer against the student's: the student's spelling of ids spread
    over its vocabulary, tokenized by the server (`/tokenize`), must give the student's ids."""
    size = int(student_tokenizer.get_vocab_size(with_added_tokens=False))
    ids = sorted({round(i * (size - 1) / (PROBE_IDS - 1)) for i in range(PROBE_IDS)})
    text = student_tokenizer.decode(ids, skip_special_tokens=True)
    want = student_tokenizer.encode(text, add_special_tokens=False).ids
    from megatron_rl_patches.teachers.http_client import Deadline  # lazy: optional dependency httpx

    model = teacher.served_model()
    reply = teacher.client.request("POST", "/tokenize", {"model": model.name, "prompt": text,
                                                         "add_special_tokens": False},
                                   Deadline.after(teacher.settings.timeout_s), threading.Event())
    got = reply.get("tokens") if isinstance(reply, dict) else None
    if got != want:
        raise ValueError(f"{where}: the served model {model.name!r} does not share the student's tokenizer (a probe "
                         f"text of {len(want)} student ids came back from {teacher.url}/tokenize as "
                         f"{'no tokens' if got is None else f'{len(got)} other ids'}): top-k OPD compares the same "
                         f"token ids; serve a teacher of the student's tokenizer")


class ServedOpdTeacher(OpdTeacher):
    """A teacher at a URL (`ServedTeacher`): its own top-k [R, k], their log-probs and the exact
    tail per sample; as the first teacher its ids become the step's (the others score them)."""

    def __init__(self, teacher: ServedTeacher, student_vocab: int) -> None:
        self.teacher = teacher
        self.student_vocab = student_vocab
        self.pending: PendingScores | None = None

    def __repr__(self) -> str:
        return f"ServedOpdTeacher({self.teacher!r})"

    def begin(self, actor: Any, rollout_data: dict) -> None:
        """The step's samples sent now (on the asking rank), before the student's pass."""
        _, asks, _ = _asking_group()
        self.pending = self.teacher.submit(batch_of(rollout_data)) if asks else None

    def score(self, step: ScoringStep) -> TeacherScores | None:
        request = step.ids_request()
        if request.k is None:  # check_served refused it before anything loaded
            raise RuntimeError("slime_opd: a served teacher is not the first; please report this")
        group, asks, last = _asking_group()
        rows = self._collect(asks)
        if not last:
            return None
        if group is not None and torch.distributed.get_world_size(group) > 1:
            shared = [rows]
            torch.distributed.broadcast_object_list(shared, src=torch.distributed.get_global_rank(group, 0),
                                                    group=group)
            rows = shared[0]
        assert rows is not None  # the asking rank's rows, agreed and shared
        data = step.rollout_data
        totals, responses = [int(t) for t in data["total_lengths"]], [int(r) for r in data["response_lengths"]]
        device = data["tokens"][0].device if len(data["tokens"]) else torch.device("cpu")
        ids, values, tails = (zigzag_of_whole([v.to(device) for v in field], totals, responses) for field in rows)
        data[IDS] = ids
        data.pop(IDS_MASK, None)
        return TeacherScores(values, tails)

    def _collect(self, asks: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None:
        """The asking rank's rows (ids, float32 log-probs, float32 tails); a failure anywhere raised
        on every rank of the job."""
        pending, self.pending = self.pending, None
        error: BaseException | None = None
        rows = None
        if asks:
            try:
                if pending is None:
                    raise RuntimeError("slime_opd: a served teacher's step was not sent before its turn; please "
                                       "report this")
                scores = pending.result()
                self.check_ids(scores)
                rows = ([i.cpu() for i in scores.topk_ids], [v.float().cpu() for v in scores.topk_log_probs],
                        [t.float().cpu() for t in scores.tail_log_probs])
            except Exception as failed:  # noqa: BLE001 - agreed over the job, then raised
                error = failed
        agree_failure(error, _world())
        return rows

    def check_ids(self, scores: BatchScores) -> None:
        for sample, ids in enumerate(scores.topk_ids):
            if ids.numel() and int(ids.max()) >= self.student_vocab:
                raise ServedTeacherRefusal(f"{self.teacher.url} (sample {sample}): the served teacher's top-k holds "
                                           f"id {int(ids.max())}, past the student's vocabulary of "
                                           f"{self.student_vocab}: serve a teacher of the student's tokenizer",
                                           self.teacher.url, sample)


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


def build_served(args: Any, settings: OpdSettings, url: str, engine: str, student_vocab: int,
                 where: str) -> ServedOpdTeacher:
    """The teacher at `url` (its own top-k, K = the settings' k), checked by the ranks that will ask
    it (the server answers, K within its --max-logprobs, the student's tokenizer); a failure on any
    rank raised on every rank of the job."""
    from megatron_rl_patches.teachers.served import ServedTeacher  # lazy: optional dependency httpx

    error: BaseException | None = None
    teacher = None
    try:
        teacher = ServedTeacher(url, engine, top_k=settings.k)
        if _asking_group()[1]:
            teacher.check()
            probe_vocabulary(teacher, student_tokenizer_of(args, where), where)
    except Exception as failed:  # noqa: BLE001 - agreed over the job, then raised
        error = failed
    try:
        agree_failure(error, _world())
    except Exception as agreed:
        raise ValueError(f"{where}: {agreed}") from agreed
    assert teacher is not None  # no error: built
    return ServedOpdTeacher(teacher, student_vocab)
