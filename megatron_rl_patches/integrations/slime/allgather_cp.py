"""slime's `--allgather-cp` (624b824a) for top-k OPD: each context-parallel rank runs the model on
a contiguous slice of the packed stream, while slime keeps every per-sample field of its rollout
data (log-probs, advantages, masks) in the zigzag rows of the rank (its
`_allgather_cp_redistribute`). Top-k OPD's [R, k] ids and buckets follow the same rule, by the row
moves every Megatron host shares (`integrations.megatron.opd.zigzag`: `zigzag_from_local`,
`local_from_zigzag`, `local_spans`); slime's zigzag (`cp_utils`) is the ops' `thd` zigzag."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from typing import Any


def allgather_cp_active(args: Any) -> bool:
    """Whether slime's `--allgather-cp` is on with more than one context-parallel rank."""
    if not getattr(args, "allgather_cp", False):
        return False
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size() > 1
