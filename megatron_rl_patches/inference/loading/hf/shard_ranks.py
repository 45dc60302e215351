"""ShardRanks: which shard of each tensor this rank reads (its tensor, expert-tensor and expert
parallel positions), from megatron-core's parallel_state by default or from a teacher's own
layout (inference/teacher_layout)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardRanks:
    tp_rank: int = 0
    tp_size: int = 1
    expert_tp_rank: int = 0
    expert_tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    def of(self, expert: bool) -> tuple[int, int]:
        """(rank, size) of the split a tensor takes: expert-tensor for experts' tensors, else tensor."""
        return (self.expert_tp_rank, self.expert_tp_size) if expert else (self.tp_rank, self.tp_size)


def parallel_state_ranks() -> ShardRanks:
    """This rank's shard positions in megatron-core's parallel_state (the student's groups)."""
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    return ShardRanks(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                      expert_tp_rank=ps.get_expert_tensor_parallel_rank(),
                      expert_tp_size=ps.get_expert_tensor_parallel_world_size(),
                      ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size())
