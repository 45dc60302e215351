"""Groups by value: the samples' longest common leading tokens, the partition into runs of the
sorted samples that saves the most (against a brute force over every such partition of a few
samples; GRPO-shaped batches: exactly their prompts' groups), a claimed group never trusted."""
from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from megatron_rl_patches.shared_prefix.grouping import Group, common_length, find_groups


def _saved(partition, samples) -> int:
    """What a partition saves: per part of g samples, (g - 1) * their shared tokens."""
    total = 0
    for part in partition:
        if len(part) < 2:
            continue
        shared = min(common_length(samples[a], samples[b]) for a, b in itertools.combinations(part, 2))
        total += (len(part) - 1) * shared
    return total


def _runs(items):
    """Every partition of `items` into runs (contiguous parts)."""
    if not items:
        yield []
        return
    for cut in range(1, len(items) + 1):
        for rest in _runs(items[cut:]):
            yield [items[:cut], *rest]


samples_strategy = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=6)


@given(samples_strategy)
def test_the_groups_save_as_much_as_the_best_partition_of_the_sorted_samples_into_runs(samples):
    groups = find_groups(samples)
    order = sorted(range(len(samples)), key=lambda i: (samples[i], i))
    best = max(_saved(p, samples) for p in _runs(order))
    assert sum(group.saved for group in groups) == best
    assert sorted(m for g in groups for m in g.members) == list(range(len(samples)))
    for group in groups:  # what a group claims to share, every member holds
        assert list(group.members) == sorted(group.members)
        for member in group.members:
            assert samples[member][:group.shared] == samples[group.members[0]][:group.shared]
            assert group.shared <= len(samples[member])


def test_two_prompts_in_one_claimed_group_are_split_by_value():
    a, b = [1, 2, 3, 4, 5], [9, 8, 7, 6, 5]
    groups = find_groups([a + [10], a + [11, 12], b + [13], b + [14]])
    assert groups == [Group((0, 1), 5), Group((2, 3), 5)]


@given(st.lists(st.integers(2, 6), min_size=1, max_size=5), st.integers(1, 8), st.randoms(use_true_random=False))
def test_grpo_shaped_batches_give_their_prompts_groups(prompt_lengths, group_size, rng):
    prompts = [[100 + p] + [rng.randrange(50) for _ in range(n - 1)] for p, n in enumerate(prompt_lengths)]
    samples, claimed = [], []
    for p, prompt in enumerate(prompts):
        for member in range(group_size):  # responses that share no first token (else a subgroup may share more)
            samples.append(prompt + [200 + member] + [rng.randrange(50) for _ in range(rng.randrange(0, 3))])
            claimed.append(p)
    members = [tuple(i for i, c in enumerate(claimed) if c == p) for p in range(len(prompts))]
    groups = find_groups(samples)
    if group_size == 1:
        assert all(group.shared == 0 for group in groups)
    else:
        assert [g.members for g in groups] == members
        assert all(g.shared >= len(prompts[p]) for p, g in enumerate(groups))


def test_identical_samples_and_a_sample_inside_another_share_it_whole():
    assert find_groups([[1, 2, 3], [1, 2, 3], [1, 2]]) == [Group((0, 1, 2), 2)]
    # a tie (both save 4): the partition found first, whose last run is the shortest
    assert find_groups([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2]]) == [Group((0, 1), 4), Group((2,), 0)]
    assert find_groups([[4, 5, 6], [4, 5, 6]]) == [Group((0, 1), 3)]


def test_a_sample_alone_and_the_least_shared_length():
    assert find_groups([[1, 2, 3], [4, 5, 6]]) == [Group((0,), 0), Group((1,), 0)]
    assert find_groups([[1, 2, 3, 9], [1, 2, 4, 9]], min_shared=3) == [Group((0,), 0), Group((1,), 0)]
    assert find_groups([[1, 2, 3, 9], [1, 2, 4, 9]], min_shared=2) == [Group((0, 1), 2)]


def test_the_groups_are_the_same_whatever_order_ties_come_in():
    samples = [[7, 7, 1], [7, 7, 2], [3, 3, 3], [7, 7, 1]]
    assert find_groups(samples) == find_groups([list(s) for s in samples])
    assert find_groups(samples)[0].members == (0, 1, 3)
