"""The samples' shared prefixes found by value at the edges the grouping's byte comparison meets:
ids past 32 bits (a stream whose ids span 2³² or more is compared as 8-byte words, not 4) grouped
and ordered as the integers they are, every row computing its own token."""
from __future__ import annotations

import torch
from kit.shared_prefix import packed_ids

from megatron_rl_patches.shared_prefix.plan import plan_shared_prefix

BIG = 2 ** 33


def test_ids_past_32_bits_are_grouped_and_ordered_as_integers():
    samples = [[5, BIG, 7], [5, BIG, 9], [5, 1, 2], [2 ** 40, 3], [5, BIG + 2 ** 32, 4]]
    tokens, cu = packed_ids(samples)
    plan = plan_shared_prefix(tokens, cu)
    assert torch.equal(plan.tokens[plan.logical_rows], tokens)  # each row computes its own token
    # 5 once for samples 0-2 and 4; BIG once for 0 and 1; every sample's rest once
    assert plan.stats.physical_tokens == 1 + 1 + 1 + 1 + 2 + 2 + 2
    top, alone = plan.tree()
    assert (top.samples, top.length, alone.samples) == ((0, 1, 2, 4), 1, (3,))
    assert [(c.samples, plan.tokens[c.start].item()) for c in top.children] == [
        ((0, 1), BIG), ((2,), 1), ((4,), BIG + 2 ** 32)]  # BIG and BIG + 2³² differ only past 32 bits
