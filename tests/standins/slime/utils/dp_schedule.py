"""Stand-in for slime.utils.dp_schedule (624b824a): the first fit it imports by name from
slime.utils.seqlen_balancing, with slime's signature and behaviour (whole lengths, in order, each
into the first micro-batch with room; a length past the budget alone). slime's own runs in the slime
lane (tests/integrations/slime/lane/test_slime_micro_batches_lane.py)."""
from __future__ import annotations


def first_fit_pack(total_lengths, max_tokens_per_bin):
    bins, sums = [], []
    for index, length in enumerate(total_lengths):
        for b, used in enumerate(sums):
            if used + length <= max_tokens_per_bin:
                bins[b].append(index)
                sums[b] += length
                break
        else:
            bins.append([index])
            sums.append(length)
    return bins
