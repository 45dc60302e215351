"""Stand-in for slime's cp_utils: `slice_log_prob_with_cp` at one context-parallel rank, where slime's
own returns the values unchanged (its zigzag cut runs on slime's real source: the slime lane)."""
from megatron.core import parallel_state


def slice_log_prob_with_cp(log_prob, total_length, response_length):
    assert len(log_prob) == response_length, (len(log_prob), response_length)
    if parallel_state.get_context_parallel_world_size() != 1:
        raise LookupError("slice_log_prob_with_cp: run the slime lane for context parallelism")
    return log_prob
