"""What build_inference_model_from_hf(layout=) hands the build: the TransformerConfig sizes, the
model's process groups, each rank's shard positions, and what a layout does not serve yet
(refused by name before anything loads)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_rl_patches.inference.loading.hf.shard_ranks import ShardRanks
from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout

if TYPE_CHECKING:  # torch.distributed: `memory --hf --teacher-tp` reads refuse_unserved without torch
    from megatron_rl_patches.inference.teacher_layout.groups import TeacherGroups


def config_sizes(layout: TeacherLayout) -> dict[str, Any]:
    """TransformerConfig's parallel sizes for `layout` (those of parallel_state are not the teacher's)."""
    return dict(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=layout.ep,
                expert_tensor_parallel_size=layout.tp, context_parallel_size=1)


def shard_ranks(groups: TeacherGroups) -> ShardRanks:
    """This rank's shard of every tensor: its position in the teacher's tensor-parallel group
    (experts split over the same group: expert-tensor size = tp, expert-parallel size 1)."""
    return ShardRanks(tp_rank=groups.tp_rank, tp_size=groups.tp_size,
                      expert_tp_rank=groups.tp_rank, expert_tp_size=groups.tp_size)


def refuse_unserved(layout: TeacherLayout, arch: Any, converter: str) -> None:
    """ValueError naming what a teacher at its own layout does not serve: mbridge's converter.
    Every family the builtin converter builds is served at a layout, at any tensor x pipeline
    size its layers divide: dense, mixture of experts (experts split over the teacher's
    tensor-parallel group), multi-latent attention (its down projections gathered in that group:
    own_groups.py) and gated-delta-net linear attention (its heads split over that group: the
    model's pg_collection); at pp > 1 each stage builds its own layers' kinds (dense first layers,
    Qwen3.5's layer_types: model_provider's pp_rank) and no stage builds an MTP layer (skipped).
    Every residency is served ("swap" / "stream": each rank's own shard built and kept in host
    memory, moved as at the student's layout). `arch`: the checkpoint's architecture (named in the error)."""
    if converter != "builtin":
        raise ValueError(f"{arch.source}: layout={layout!r} does not serve converter={converter!r} (only 'builtin' "
                         "is served at a teacher's own layout) yet; pass layout=None to build the teacher in the "
                         "student's own process groups")
