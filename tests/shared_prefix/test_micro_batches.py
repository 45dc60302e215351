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
    ([[1, 2], [1, 1.7]], 4, r"samples\[1\]\[1\] must be an int token id, got 1.7 \(float\)"),
    ([[1, "2"]], 4, r"samples\[0\]\[1\] must be an int token id, got '2' \(str\)"),
    ([[1, None, 3]], 4, r"samples\[0\]\[1\] must be an int token id, got None"),
    ([[1, 2], [3, -1]], 4, r"samples\[1\]\[1\] is -1, not a token id"),
    ([[1, 2 ** 64]], 4, r"samples\[0\]\[1\] is 18446744073709551616, not a token id"),
    ([torch.tensor([1.0, 2.0])], 4, "1-D tensor of ids"),
    ([torch.tensor([True, False])], 4, "1-D tensor of ids"),
    (None, 4, "samples must be a list of samples"),
    (torch.tensor([[1, 2]]), 4, "samples must be a list of samples"),
])
def test_bad_input_is_refused_by_name(samples, budget, message):
    with pytest.raises((ValueError, TypeError), match=message):
        shared_prefix_micro_batches(samples, budget)


@pytest.mark.parametrize("min_shared", ["x", -5, 0, 1.5, True, None])
def test_a_min_shared_that_is_no_count_of_tokens_is_refused_by_name(min_shared):
    with pytest.raises(ValueError, match=rf"min_shared must be an int >= 1 .*got {min_shared!r}"):
        shared_prefix_micro_batches([[1, 2, 3], [1, 2, 4]], 8, min_shared=min_shared)


def test_ids_in_every_form_give_the_same_micro_batches_and_are_left_as_given():
    import numpy as np

    samples = _grpo([30, 20], 4)
    forms = [samples, [torch.tensor(s) for s in samples], [tuple(s) for s in samples],
             [np.array(s) for s in samples], [[np.int64(t) for t in s] for s in samples],
             [[2 ** 40 + t for t in s] for s in samples]]  # past 32 bits: the 64-bit path
    given = [list(s) for s in samples]
    results = [shared_prefix_micro_batches(form, 60) for form in forms]
    assert all(result == results[0] for result in results) and len(results[0]) == 2  # a group each
    assert samples == given


def test_no_garbage_collection_runs_while_micro_batches_are_found_and_the_setting_is_restored():
    """The grouping makes no reference cycles; a full collection in it walked every sample the caller
    holds (19M references at 16,384 samples of 1,152 ids), so its cost grew as n^2. Collections
    are paused inside (3,000 samples sharing nothing: about 15,000 new objects, some twenty
    collections before) and the caller's setting comes back: on, off, and after a refusal."""
    import gc
    import sys

    from megatron_rl_patches.shared_prefix.grouping import find_groups

    samples = [[i, i % 7] for i in range(3000)]
    collections: list[int] = []

    def record(phase, info):  # a collection started while the package's grouping code runs
        frame = sys._getframe(1)
        while frame is not None and phase == "start":
            if frame.f_code.co_filename.endswith(("shared_prefix/grouping.py", "shared_prefix/micro_batches.py")):
                collections.append(info["generation"])
                return
            frame = frame.f_back

    gc.callbacks.append(record)
    try:
        gc.collect()
        groups = find_groups(samples)
        gc.collect()
        batches = shared_prefix_micro_batches(samples, 40)
        seen = list(collections)
        enabled_after = gc.isenabled()
        with pytest.raises(ValueError, match=r"samples\[1\] is empty"):
            shared_prefix_micro_batches([[1], []], 40)
        enabled_after_refusal = gc.isenabled()
        gc.disable()
        shared_prefix_micro_batches(samples[:10], 40)
        find_groups(samples[:10])
        disabled_kept = not gc.isenabled()
    finally:
        gc.callbacks.remove(record)
        gc.enable()
    assert len(seen) <= 2, seen  # at most the one each call owes when the collector is back on
    assert enabled_after and enabled_after_refusal and disabled_kept
    assert len(groups) == 3000 and not any(g.shared for g in groups)
    assert sorted(i for batch in batches for i in batch) == list(range(3000))


def test_ids_are_kept_in_the_narrowest_array_and_every_negative_id_refused():
    from megatron_rl_patches.shared_prefix.micro_batches import sample_ids

    assert sample_ids([1, 2**32 - 1], 0).typecode == "I" and sample_ids([2**40, 2**63 - 1], 0).typecode == "q"
    assert list(sample_ids(torch.tensor([3, 2**55]), 0)) == [3, 2**55]
    for negative in (-1, -(2**62), -(2**55)):
        with pytest.raises(ValueError, match=rf"samples\[4\]\[1\] is {negative}, not a token id"):
            sample_ids([2**63 - 1, negative], 4)  # the largest id taken, the negative named
        with pytest.raises(ValueError, match=rf"samples\[0\]\[0\] is {negative}, not a token id"):
            sample_ids([negative], 0)  # -2**62: only its top byte holds a sign bit
    with pytest.raises(ValueError, match=r"samples\[2\] must be a 1-D tensor of ids, got \(2,\) torch.int64 on meta"):
        sample_ids(torch.tensor([1, 2], device="meta"), 2)


def test_largest_parts_first_each_into_the_first_micro_batch_with_room():
    # ten samples of no shared prompt: five of 8 ids, five of 2, budget 10: each 8 with a 2 (5 micro-batches;
    # in the given order the 2s would fill one and the 8s five more)
    samples = [[100 + i] * 2 for i in range(5)] + [[200 + i] * 8 for i in range(5)]
    assert shared_prefix_micro_batches(samples, 10) == [[0, 5], [1, 6], [2, 7], [3, 8], [4, 9]]
    # eight of 5 then four of 3, budget 8: the 3s go into the first four micro-batches, in order
    samples = [[300 + i] * 5 for i in range(8)] + [[400 + i] * 3 for i in range(4)]
    assert shared_prefix_micro_batches(samples, 8) == [[0, 8], [1, 9], [2, 10], [3, 11], [4], [5], [6], [7]]
    assert shared_prefix_micro_batches([[1], [2]], 1) == [[0], [1]]  # a budget of one token


def test_once_per_step_a_group_the_budget_cuts_lies_in_consecutive_micro_batches_counted_once():
    from megatron_rl_patches.apps.bench.shared_prefix_budgets import group_samples, trie_size

    samples = group_samples(300, 20, 20, seed=1) + group_samples(40, 100, 4, seed=2) + [list(range(500, 530))]
    per_step = shared_prefix_micro_batches(samples, 400, held_cost=0.0)
    places = {i: m for m, batch in enumerate(per_step) for i in batch}
    for members in (range(20), range(20, 24)):  # each group's parts in consecutive micro-batches
        used = sorted({places[i] for i in members})
        assert used == list(range(used[0], used[-1] + 1))
    assert sorted(i for batch in per_step for i in batch) == list(range(len(samples)))
    assert len({places[i] for i in range(20)}) == 2  # the prompt and 5 tails, then the 15 other tails on it held
    # each micro-batch's own rows and first reads within the budget, the step's tokens the trie's
    from megatron_rl_patches.shared_prefix import plan_shared_prefix_step

    def packed(batch):
        bounds = [0]
        for i in batch:
            bounds.append(bounds[-1] + len(samples[i]))
        return torch.tensor([t for i in batch for t in samples[i]]), bounds

    step = plan_shared_prefix_step([packed(b) for b in per_step], max_tokens=400)
    assert step.stats.computed_tokens == trie_size(samples)
    assert all(plan.held.computed.numel() <= 400 for plan in step.plans)
    dear = plan_shared_prefix_step([packed(b) for b in shared_prefix_micro_batches(samples, 400, held_cost=1.0)],
                                   max_tokens=400)  # a held row as dear as a computed one: both within the budget
    assert all(plan.held.computed.numel() + plan.held.held_rows <= 400 for plan in dear.plans)
    assert any(plan.held.computed.numel() + plan.held.held_rows > 400 for plan in step.plans)
    each = shared_prefix_micro_batches(samples, 400)  # per micro-batch: a cut group's prompt again in each part
    assert sum(plan_shared_prefix(*packed(b)).stats.physical_tokens for b in each) > trie_size(samples)


def test_once_per_step_a_sample_past_the_budget_is_taken_and_a_bad_held_cost_refused():
    long = [list(range(1000))]
    assert shared_prefix_micro_batches(long, 300, held_cost=0.5) == [[0]]
    with pytest.raises(ValueError, match="more than max_tokens=300: raise max_tokens, cut the sample, or plan"):
        shared_prefix_micro_batches(long, 300)
    for bad in (-0.1, 1.5, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match=r"held_cost must be a number from 0 to 1 \(a held row's bytes over a "):
            shared_prefix_micro_batches(long, 300, held_cost=bad)


def test_at_slimes_budgets_once_per_step_computes_the_samples_trie():
    """The planner's table (docs/benchmarks.md) on two of its rows: once per step, the step computes
    the samples' trie exactly (padding none), once per micro-batch more."""
    from megatron_rl_patches.apps.bench.shared_prefix_budgets import SHAPES, budget_row, group_samples

    for shape, prompt, response, group, budget in (SHAPES[0], SHAPES[-1]):
        row = budget_row(shape, group_samples(prompt, response, group), budget)
        assert row.per_step == row.trie < row.per_micro_batch <= row.packed
    assert row.per_micro_batch == row.packed and round(row.per_step / row.packed, 3) == 0.180  # the CPU shape
