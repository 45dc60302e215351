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
from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout
from megatron_rl_patches.inference.teacher_layout.scoring import topk_at_layout
from megatron_rl_patches.integrations.slime import hf_teachers
from megatron_rl_patches.integrations.slime.opd_settings import TEACHERS, OpdSettings, Teacher
from megatron_rl_patches.integrations.slime.opd_teachers import ScoringStep, SeparateTeacher, TeacherScores
from megatron_rl_patches.integrations.slime.step_plan import IDS
from megatron_rl_patches.patching.layout_option import check_world


def process_group_collection_class() -> type:
    """megatron-core's ProcessGroupCollection (ValueError naming the version that lacks it)."""
    return groups.process_group_collection_class()


def student_sizes() -> dict[str, int]:
    """The student's pipeline and context-parallel sizes (megatron-core's parallel_state)."""
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    return {"pipeline": ps.get_pipeline_model_parallel_world_size(), "context": ps.get_context_parallel_world_size()}


def check_layout_teachers(settings: OpdSettings, routes: list[str | None], snapshot: str) -> None:
    """ValueError naming the entry for each `;tp=N` / `;pp=N` teacher the run cannot serve: a world the size
    does not divide, a route other than a Hugging Face directory of another architecture
    (`snapshot`: slime's route into the actor's buffers), the union of ids, a student with pipeline
    or context parallelism (any residency is served). The same on every rank (the routes are
    agreed, the rest is the same everywhere), before anything loads."""
    at_layout = [(teacher, route) for teacher, route in zip(settings.teachers, routes) if teacher.at_layout]
    if not at_layout:
        return
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    sizes = student_sizes()
    for teacher, route in at_layout:
        where = f"{TEACHERS} entry '{teacher.path};{teacher.layout_written}'"
        check_world(int(teacher.tp or 1), world, where, int(teacher.pp or 1))
        if route == snapshot:
            raise ValueError(f"{where}: this checkpoint goes slime's snapshot route (a Megatron checkpoint, or a "
                             "Hugging Face directory of the actor's architecture: loaded into the actor's own buffers, "
                             "at the student's layout); ';tp=' serves Hugging Face directories of another "
                             "architecture: drop ';tp=' / ';pp='")
        if settings.ids_from == "union":
            raise ValueError(f"{where} with MEGATRON_RL_PATCHES_OPD_IDS_FROM=union: a teacher at its own layout "
                             "scores the student's ids only; use ids from the student or drop ';tp=' / ';pp='")
        for kind, size in sizes.items():
            if size > 1:
                raise ValueError(f"{where}: the student runs with {kind} parallelism ({kind} size {size}); a "
                                 "teacher at its own layout is served beside a student without it yet: drop ';tp=' / "
                                 "';pp='")
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
                                          f"{TEACHERS}: teacher {teacher.path!r}", layout=layout)
    return LayoutTeacher(chunks, temperature=float(getattr(args, "rollout_temperature", 1.0) or 1.0))


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
        """[R, k] log-probs at the step's ids and [R] tails per sample of this rank."""
        data = step.rollout_data
        tokens = list(data["tokens"]) if step.last else []
        ids = list(data[IDS]) if step.last else []
        totals = [int(t) for t in data["total_lengths"]][: len(tokens)]
        responses = [int(r) for r in data["response_lengths"]][: len(tokens)]
        longest = max(totals, default=0)
        k = int(ids[0].shape[1]) if ids else 0
        # every other row gets the distinct placeholder ids 0..k-1 (scored, never read)
        placeholder = torch.arange(k, dtype=torch.int64).expand(len(tokens), longest, k).clone()
        for row, sample_ids, total, response in zip(placeholder, ids, totals, responses):
            row[total - response - 1: total - 1] = sample_ids.cpu()  # the logits rows of the response tokens
        logp, tail = topk_at_layout(self, _padded(tokens, longest), placeholder, temperature=self.temperature)
        if not step.last:
            return None
        device = ids[0].device if ids else torch.device("cpu")
        spans = [slice(total - response - 1, total - 1) for total, response in zip(totals, responses)]
        return TeacherScores([logp[i, span].to(device) for i, span in enumerate(spans)],
                             [tail[i, span].to(device) for i, span in enumerate(spans)])
