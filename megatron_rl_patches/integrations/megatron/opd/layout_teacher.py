"""slime_opd's Hugging Face teacher at its own tensor / pipeline-parallel layout (`PATH;tp=N`,
`PATH;pp=M`, `PATH;tp=N;pp=M`): built over all ranks on its own process groups
(`build_inference_model_from_hf(layout=)`), scored through `topk_at_layout` instead of slime's
pipelined pass. Each rank hands its own samples (right-padded to its longest: attention is causal,
padding never changes a real row), the ranks of one teacher replica (tp x pp ranks) run one forward
on all their samples (stage by stage at pp > 1), and each rank keeps its samples' [R, k] log-probs
at the step's ids and [R] tails on slime's response rows (the logits row before each response
token: rows total - R - 1 .. total - 2 of a sample).

What it does not serve is refused by name when the teachers load (`check_layout_teachers`), on
every rank, before any teacher is built."""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.inference.teacher_layout import groups
from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout, check_world
from megatron_rl_patches.inference.teacher_layout.scoring import select_topk_at_layout, topk_at_layout
from megatron_rl_patches.integrations.megatron.opd import hf_teachers
from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, OpdSettings, Teacher
from megatron_rl_patches.integrations.megatron.opd.opd_teachers import ScoringStep, SeparateTeacher, TeacherScores
from megatron_rl_patches.integrations.megatron.opd.topk_request import IDS, TopkRequest
from megatron_rl_patches.integrations.megatron.opd.zigzag import whole_from_zigzag, zigzag_of_whole
from megatron_rl_patches.ops import agreement


def process_group_collection_class() -> type:
    """megatron-core's ProcessGroupCollection (ValueError naming the version that lacks it)."""
    return groups.process_group_collection_class()


def context_parallel() -> tuple[int, int]:
    """The student's context-parallel (size, rank)."""
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    return ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()


def summed_over_context(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-sample tensors summed over the student's context-parallel group (each sample's values
    set on one rank, zeros on the others: every rank gets them all)."""
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    if not values:
        return []
    flat = agreement.summed(ps.get_context_parallel_group(), torch.cat([v.reshape(-1) for v in values]))
    return [part.view(v.shape) for part, v in zip(flat.split([v.numel() for v in values]), values)]


def student_sizes() -> dict[str, int]:
    """The student's pipeline and context-parallel sizes (megatron-core's parallel_state)."""
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    return {"pipeline": ps.get_pipeline_model_parallel_world_size(), "context": ps.get_context_parallel_world_size()}


def check_layout_teachers(settings: OpdSettings, loadings: list[str | None], snapshot: str) -> None:
    """ValueError naming the entry for each `;tp=N` / `;pp=N` teacher the run cannot serve: a world the size
    does not divide, a loading other than a Hugging Face directory of another architecture
    (`snapshot`: slime's loading into the actor's buffers), the union of ids (any residency, and a
    student with pipeline or context parallelism, are served: `LayoutTeacher.score`). The same on
    every rank (the loadings are agreed, the rest is the same everywhere), before anything loads."""
    at_layout = [(teacher, loading) for teacher, loading in zip(settings.teachers, loadings) if teacher.at_layout]
    if not at_layout:
        return
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    for teacher, loading in at_layout:
        where = f"{TEACHERS} entry '{teacher.path};{teacher.layout_written}'"
        check_world(int(teacher.tp or 1), world, where, int(teacher.pp or 1))
        if loading == snapshot:
            raise ValueError(f"{where}: this checkpoint goes slime's snapshot route (a Megatron checkpoint, or a "
                             "Hugging Face directory of the actor's architecture: loaded into the actor's own buffers, "
                             "at the student's layout); ';tp=' serves Hugging Face directories of another "
                             "architecture: drop ';tp=' / ';pp='")
        if settings.ids_from == "union":
            raise ValueError(f"{where} with MEGATRON_RL_PATCHES_OPD_IDS_FROM=union: a teacher at its own layout "
                             "scores the student's ids only; use ids from the student or drop ';tp=' / ';pp='")
        if settings.ids_from == "teacher" and teacher is settings.teachers[0]:
            raise ValueError(f"{where} first with MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher: a teacher at its own "
                             "layout scores given ids only, it selects none; name another teacher first, use ids "
                             "from the student, or drop ';tp=' / ';pp='")
    try:
        process_group_collection_class()
    except ValueError as exc:
        raise ValueError(f"{TEACHERS} entry '{at_layout[0][0].path};{at_layout[0][0].layout_written}': {exc}"
                         ) from None


def build_layout_teacher(args: Any, teacher: Teacher, student: int | str, actor_config: Any,
                         residency: str | None = None) -> LayoutTeacher:
    """The `;tp=N;pp=M` teacher built at TeacherLayout(tp=N, pp=M) (a collective: every rank builds it);
    `residency`: MEGATRON_RL_PATCHES_OPD_RESIDENCY's (swap / stream: each rank's own shard in host memory,
    brought in by each scoring pass's forward)."""
    layout = TeacherLayout(tp=int(teacher.tp or 1), pp=int(teacher.pp or 1))
    chunks = hf_teachers.build_hf_teacher(args, teacher.path, residency, student, actor_config,
                                          f"{TEACHERS}: teacher {teacher.path!r}", own_tokenizer=teacher.own_tokenizer,
                                          layout=layout)
    return LayoutTeacher(chunks, temperature=float(getattr(args, "rollout_temperature", 1.0) or 1.0))


def _response_rows(data: dict) -> tuple[list[torch.Tensor], list[slice]]:
    """Each sample's tokens and the logits rows of its response tokens (total - R - 1 .. total - 2)."""
    tokens = list(data["tokens"])
    totals = [int(t) for t in data["total_lengths"]][: len(tokens)]
    responses = [int(r) for r in data["response_lengths"]][: len(tokens)]
    return tokens, [slice(total - response - 1, total - 1) for total, response in zip(totals, responses)]


def _agreed_width(ids: list[torch.Tensor]) -> int:
    """The ids' k over every rank (a rank without samples learns it from the others)."""
    return agreement.agreed_max(agreement.world(), int(ids[0].shape[-1]) if ids else 0)


def _padded(samples: list[torch.Tensor], length: int) -> torch.Tensor:
    out = torch.zeros(len(samples), length, dtype=torch.int64)
    for row, sample in enumerate(samples):
        out[row, : sample.shape[0]] = sample.cpu()
    return out


class LayoutTeacher(SeparateTeacher):
    """A SeparateTeacher built at its own layout: its chunks carry their groups (`teacher_groups`),
    and it scores through `topk_at_layout` (every rank of the world takes part in each step)."""

    def __init__(self, chunks: list[Any], temperature: float = 1.0):
        super().__init__(chunks)
        self.temperature = temperature

    def score(self, step: ScoringStep) -> TeacherScores | None:
        """[R, k] log-probs at the step's ids and [R] tails per sample of this rank, in the rows
        slime keeps per-sample fields in. A student with pipeline parallelism: the stages before
        the last take part with no samples. With context parallelism every context-parallel rank
        holds the same samples (its zigzag rows of their ids): the ids are made whole, each rank
        has the teacher score every cp-th sample, the whole scores are summed over the
        context-parallel group and each rank keeps its own rows."""
        data = step.rollout_data
        count = len(data["tokens"]) if step.last else 0
        totals = [int(t) for t in data["total_lengths"]][:count]
        responses = [int(r) for r in data["response_lengths"]][:count]
        cp_size, cp_rank = context_parallel()
        ids = whole_from_zigzag(list(data[IDS]), totals, responses) if count else []
        mine = [i for i in range(count) if i % cp_size == cp_rank]
        tokens = [data["tokens"][i] for i in mine]
        longest = max((totals[i] for i in mine), default=0)
        k = int(ids[0].shape[1]) if ids else 0
        # every other row gets the distinct placeholder ids 0..k-1 (scored, never read)
        placeholder = torch.arange(k, dtype=torch.int64).expand(len(mine), longest, k).clone()
        spans = [slice(totals[i] - responses[i] - 1, totals[i] - 1) for i in mine]
        for row, i, span in zip(placeholder, mine, spans):
            row[span] = ids[i].cpu()  # the logits rows of the response tokens
        logp, tail = topk_at_layout(self, _padded(tokens, longest), placeholder, temperature=self.temperature,
                                    invariant=step.invariant)
        if not step.last:
            return None
        device = ids[0].device if ids else torch.device("cpu")
        # every sample's rows start as zeros where the scores are (the model's device): the
        # context-parallel sum concatenates them with this rank's scored rows
        logps = [torch.zeros(r, k, device=logp.device) for r in responses]
        tails = [torch.zeros(r, device=tail.device) for r in responses]
        for row, (i, span) in enumerate(zip(mine, spans)):
            logps[i], tails[i] = logp[row, span], tail[row, span]
        if cp_size > 1:  # every sample's whole scores on every context-parallel rank, then its own rows
            logps, tails = (zigzag_of_whole(summed_over_context(values), totals, responses)
                            for values in (logps, tails))
        return TeacherScores([v.to(device) for v in logps], [v.to(device) for v in tails])

    def topk_pass(self, step: ScoringStep, chunks: list[Any], rollout_data: dict,
                  request: TopkRequest) -> dict[str, list[torch.Tensor]]:
        """A pass over `rollout_data` (a teacher with another tokenizer: its own encoding of the
        samples) at the teacher's layout, per sample on the response rows: with `request.k` the
        log-probs of the response tokens ("log_probs") and the teacher's own top-k ids
        ("topk_ids"); with `request.ids_key` the log-probs at those ids ("topk_log_probs", the
        slots `request.mask_key` marks False left in the tail) and the tails ("tail"). A
        collective: every rank calls it once per pass, with or without samples."""
        invariant = None if step is None else step.invariant  # the student's mode (None: the setting's)
        tokens, spans = _response_rows(rollout_data)
        longest = max((t.shape[0] for t in tokens), default=0)
        padded = _padded(tokens, longest)
        device = tokens[0].device if tokens else torch.device("cpu")
        if request.k is not None:
            labels = torch.zeros_like(padded)
            labels[:, :-1] = padded[:, 1:]  # Megatron's labels: the token after each position
            logp, ids = select_topk_at_layout(self, padded, labels, int(request.k), temperature=self.temperature,
                                              invariant=invariant)
            return {"log_probs": [logp[i, span].to(device) for i, span in enumerate(spans)],
                    "topk_ids": [ids[i, span].to(device) for i, span in enumerate(spans)]}
        given = list(rollout_data[request.ids_key])
        k = _agreed_width(given)
        # the rows outside the responses get the distinct placeholder ids 0..k-1 (scored, never read)
        ids = torch.arange(k, dtype=torch.int64).expand(len(tokens), longest, k).clone()
        mask = torch.ones(len(tokens), longest, k, dtype=torch.bool)
        masks = list(rollout_data[request.mask_key]) if request.mask_key is not None else [None] * len(given)
        for row, span, sample_ids, sample_mask in zip(range(len(tokens)), spans, given, masks):
            ids[row, span] = sample_ids.cpu()
            if sample_mask is not None:
                mask[row, span] = sample_mask.cpu().bool()
        logp, tail = topk_at_layout(self, padded, ids, temperature=self.temperature, ids_mask=mask,
                                    invariant=invariant)
        return {"topk_log_probs": [logp[i, span].to(device) for i, span in enumerate(spans)],
                "tail": [tail[i, span].to(device) for i, span in enumerate(spans)]}
