"""Micro-batches counted in physical tokens: every micro-batch's plan within the budget, each group
whole where it fits (cut into parts carrying the prefix where it does not), samples in order, more
samples per micro-batch than whole-sample counting allows; bad input refused by name."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_rl_patches.shared_prefix import plan_shared_prefix, shared_prefix_micro_batches


def _grpo(prompts, group_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for p, length in enumerate(prompts):
        prompt = [500 + p] + torch.randint(0, 50, (length - 1,), generator=gen).tolist()
        samples += [prompt + [300 + m] + torch.randint(0, 50, (m % 4,), generator=gen).tolist()
                    for m in range(group_size)]
    return samples


def _physical(samples, indices):
    chosen = [samples[i] for i in indices]
    tokens = torch.tensor([t for s in chosen for t in s])
    cu = [0]
    for s in chosen:
        cu.append(cu[-1] + len(s))
    return plan_shared_prefix(tokens, cu).stats.physical_tokens


@given(st.lists(st.integers(2, 40), min_size=1, max_size=5), st.integers(1, 8), st.integers(48, 200))
def test_every_micro_batch_fits_and_every_sample_is_placed_once(prompts, group_size, budget):
    samples = _grpo(prompts, group_size)
    batches = shared_prefix_micro_batches(samples, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(samples)))
    for batch in batches:
        assert batch == sorted(batch) and _physical(samples, batch) <= budget


def test_a_group_stays_whole_where_it_fits_and_is_cut_with_its_prefix_where_not():
    samples = _grpo([100, 100], 8)  # each group: 100 + 8 own tokens... about 124 physical
    assert shared_prefix_micro_batches(samples, 130) == [list(range(8)), list(range(8, 16))]
    cut = shared_prefix_micro_batches(samples, 110)  # a group no longer fits: parts, each with the prompt
    assert len(cut) == 4 and all(set(b) <= set(range(8)) or set(b) <= set(range(8, 16)) for b in cut)
    whole = sum(len(s) for s in samples[:8])
    assert whole > 8 * 100  # counting whole samples, 110 tokens would hold one sample per micro-batch


@pytest.mark.parametrize(("samples", "budget", "message"), [
    ([[1, 2, 3]], 0, "max_tokens must be an int >= 1"),
    ([[1, 2, 3], [1, 2, 3, 4, 5]], 4, r"samples\[1\] has 5 tokens, more than max_tokens=4"),
    ([[]], 4, r"samples\[0\] is empty"),
    ([torch.ones(2, 2, dtype=torch.long)], 4, "1-D tensor of ids"),
    (["abc"], 4, "1-D tensor or a list of ids"),
])
def test_bad_input_is_refused_by_name(samples, budget, message):
    with pytest.raises((ValueError, TypeError), match=message):
        shared_prefix_micro_batches(samples, budget)
