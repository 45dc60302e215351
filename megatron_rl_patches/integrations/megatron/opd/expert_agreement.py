"""How many micro-batches a teacher's own passes run where expert parallelism pairs up the ranks'
forwards: an MoE layer's token dispatcher makes collectives over the expert-parallel group at every
forward, so every rank of that group runs as many forwards (a rank that runs fewer leaves the
others waiting in a collective: a hang). The data-parallel ranks hold different samples, so a plan
made from a rank's own samples (a teacher with another tokenizer: its own token counts) is agreed
over them first: the most any of them plans."""
# lazy imports: import cost: megatron.core takes seconds; the settings checks import this package without it
from __future__ import annotations

from megatron_rl_patches.ops import agreement


def agreed_micro_batches(count: int) -> int:
    """`count` with one expert-parallel rank; with several, the most micro-batches any
    data-parallel rank (context-parallel ranks included) plans: an all-reduce MAX over that group,
    which holds every rank an expert-parallel group pairs up with this one's replicas."""
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_world_size() == 1:
        return count
    return agreement.agreed_max(parallel_state.get_data_parallel_group(with_context_parallel=True), count)
