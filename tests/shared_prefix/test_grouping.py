"""Groups by value: the samples' longest common leading tokens, the partition into runs of the
sorted samples that saves the most (against a brute force over every such partition of a few
samples; GRPO-shaped batches: exactly their prompts' groups), a claimed group never trusted."""
from __future__ import annotations

import itertools

import pytest
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


def _quadratic_groups(samples, min_shared=1):
    """The dynamic programme as it was (O(n^2): every run ending at each sorted sample), kept as the
    reference the fast one must equal, ties included."""
    order = sorted(range(len(samples)), key=lambda i: (list(samples[i]), i))
    adjacent = [common_length(samples[order[j]], samples[order[j + 1]]) for j in range(len(order) - 1)]
    firsts = _quadratic_firsts(adjacent, min_shared)
    runs = []
    for first, end in zip(firsts, [*firsts[1:], len(order)]):
        shared = min(adjacent[first:end - 1]) if end - first > 1 else 0
        runs.append(Group(tuple(sorted(order[first:end])), shared))
    return sorted(runs, key=lambda group: group.members[0])


# few token values and shared stems: many ties, runs inside runs; odd ids take the lists' path
_token = st.one_of(st.integers(0, 2), st.integers(0, 2), st.sampled_from([-1, 2 ** 40, 2 ** 70]))
_stems = st.lists(st.lists(_token, min_size=0, max_size=5), min_size=1, max_size=3)


@given(_stems, st.lists(st.tuples(st.integers(0, 2), st.lists(_token, max_size=4)), min_size=1, max_size=40),
       st.integers(1, 4))
def test_the_fast_groups_equal_the_quadratic_ones_ties_and_all(stems, picks, min_shared):
    samples = [stems[stem % len(stems)] + tail or [0] for stem, tail in picks]
    assert find_groups(samples, min_shared) == _quadratic_groups(samples, min_shared)


def _adjacent_patterns(n):
    """What sorted neighbours share, in the shapes that stress a stack of minima: one prompt for
    all, rising, falling, a tent, a sawtooth, deep valleys, binary nesting."""
    return {"one prompt": [1024] * (n - 1), "rising": list(range(1, n)), "falling": list(range(n - 1, 0, -1)),
            "tent": [min(i, n - i) + 1 for i in range(n - 1)], "sawtooth": [1 + i % 64 for i in range(n - 1)],
            "valleys": [1 if i % 2 else 1000 + i for i in range(n - 1)],
            "nested": [1 + bin(i + 1)[::-1].index("1") for i in range(n - 1)]}


def _quadratic_steps(adjacent):
    """The old programme's inner steps (the runs it tried)."""
    steps = 0
    for end in range(1, len(adjacent) + 2):
        shared = None
        for first in range(end - 2, -1, -1):
            shared = adjacent[first] if shared is None else min(shared, adjacent[first])
            steps += 1
    return steps


def test_the_programmes_steps_grow_as_n_log_n_not_n_squared():
    from megatron_rl_patches.shared_prefix.grouping import runs_saving_most

    small, large = _adjacent_patterns(512), _adjacent_patterns(2048)
    for name in small:
        counts = []
        for adjacent in (small[name], large[name]):
            steps: list[int] = []
            runs_saving_most(adjacent, 1, steps)
            counts.append(steps[0])
            n = len(adjacent) + 1
            assert steps[0] <= 3 * n * n.bit_length(), name  # n log n, with room for the constant
        assert counts[1] <= 5.5 * counts[0], (name, counts)  # 4x samples: at most 4 * 11 / 9 (n log n) and change
    quadratic = [_quadratic_steps(_adjacent_patterns(n)["one prompt"]) for n in (128, 512)]
    assert quadratic[1] >= 14 * quadratic[0]  # what the ratio catches: the old programme's 4x samples, 16x steps


def test_runs_saving_most_reads_only_what_neighbours_share():
    from megatron_rl_patches.shared_prefix.grouping import runs_saving_most

    assert runs_saving_most([]) == [0]
    assert runs_saving_most([5, 5, 5]) == [0]  # one run of four
    assert runs_saving_most([5, 0, 5]) == [0, 2]  # nothing crosses a zero
    assert runs_saving_most([3, 9, 3], min_shared=4) == [0, 1, 3]  # only the middle pair shares 4
    assert runs_saving_most([2, 10, 10, 2]) == [0, 1, 4]  # 1..3 share 10 (20 saved), not all five 2 (8)
    assert runs_saving_most([2, 4]) == [0, 1]  # a tie (all three at 2, or 1 and 2 at 4: 4 each): the shorter last run


def _quadratic_firsts(adjacent, min_shared):
    """The old programme on what neighbours share: every run ending at each sample."""
    n = len(adjacent) + 1
    best, start = [0] * (n + 1), [0] * (n + 1)
    for end in range(1, n + 1):
        best[end], start[end] = best[end - 1], end - 1
        shared = None
        for first in range(end - 2, -1, -1):
            shared = adjacent[first] if shared is None else min(shared, adjacent[first])
            if shared < min_shared:
                break
            if best[first] + (end - 1 - first) * shared > best[end]:
                best[end], start[end] = best[first] + (end - 1 - first) * shared, first
    firsts, end = [], n
    while end > 0:
        firsts.append(start[end])
        end = start[end]
    return firsts[::-1]


def test_long_random_neighbour_patterns_give_the_quadratic_runs():
    """Deep hulls and envelopes (dozens of samples, many segments merged and lines popped): the small
    samples of the property above rarely build them."""
    import random

    from megatron_rl_patches.shared_prefix.grouping import runs_saving_most

    rng = random.Random(110)
    for case in range(300):
        n = rng.randrange(2, 90)
        top = rng.choice([3, 12, 200])
        adjacent = [rng.randrange(0, top + 1) if case % 3 else rng.randrange(top // 2, top + 1) for _ in range(n - 1)]
        min_shared = rng.choice([1, 1, 2])
        assert runs_saving_most(adjacent, min_shared) == _quadratic_firsts(adjacent, min_shared), (adjacent, min_shared)


def test_each_hull_and_envelope_move_is_counted_once():
    """The step count the growth test reads: n, plus one per hull point pushed or dropped, per probe of a
    hull's or the envelope's binary search."""
    from megatron_rl_patches.shared_prefix.grouping import runs_saving_most

    counts = {}
    for name, adjacent in _adjacent_patterns(16).items():
        steps: list[int] = []
        runs_saving_most(adjacent, 1, steps)
        counts[name] = steps[0]
    assert counts == PINNED_STEPS, counts


PINNED_STEPS = {'one prompt': 57, 'rising': 88, 'falling': 64, 'tent': 101, 'sawtooth': 88, 'valleys': 66, 'nested': 67}


def test_arrays_of_64_bit_ids_share_what_lists_of_them_share():
    """Arrays ('q', 'Q') are compared as 8-byte tokens (4 for 'I'), a difference at the ninth token
    found there, as in the same ids as lists."""
    from array import array

    first, second = list(range(1, 10)), [*range(1, 9), 10]
    for code in ("q", "Q", "I"):
        groups = find_groups([array(code, first), array(code, second), array(code, [7])])
        assert groups == find_groups([first, second, [7]]) == [Group((0, 1), 8), Group((2,), 0)], code


def test_signed_arrays_sort_as_their_numbers_negative_ids_first():
    """Samples given as 'q' arrays are compared as bytes with their sign bit flipped: a negative id
    sorts before 0 as the numbers do (read as unsigned bytes it would sort after every positive id)."""
    from array import array

    from megatron_rl_patches.shared_prefix.grouping import sorted_with_neighbours

    samples = [array("q", [5, 1, 2]), array("q", [-3, 1]), array("q", [-3, 1, 7]), array("q", [0])]
    order, common = sorted_with_neighbours(samples)
    assert order == sorted(range(len(samples)), key=lambda i: list(samples[i])) == [1, 2, 3, 0]
    assert common == [2, 0, 0]


@pytest.mark.parametrize("prompt", [0, 1, 5])
def test_samples_of_one_prompt_sort_and_share_as_their_token_lists(prompt):
    """What every sample shares is cut off before sorting (the common prefix of the least and greatest
    key): order and common lengths equal those of the token lists, a sample that is the prompt alone
    and identical samples included."""
    import random

    from megatron_rl_patches.shared_prefix.grouping import common_length, sorted_with_neighbours

    rng = random.Random(prompt)
    head = [rng.randrange(70_000) for _ in range(prompt)]
    samples = [head + [rng.randrange(3) for _ in range(rng.randrange(4))] for _ in range(40)] + [list(head)] * 2
    order, common = sorted_with_neighbours(samples)
    assert order == sorted(range(len(samples)), key=lambda i: samples[i])
    assert common == [common_length(samples[a], samples[b]) for a, b in zip(order, order[1:])]
    assert min(common) >= prompt
