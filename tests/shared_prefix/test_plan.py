"""The plan of a micro-batch's physical stream: every logical row's physical row computes that row
(its token, its position, and exactly its own sample's earlier tokens visible), the prefix's last row
serves each member's first own token, padding is never shared and each padding row is computed as
packed (its own id, its position in its padding sequence, that sequence's earlier rows), bad input
is refused by name."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.shared_prefix import packed_ids

from megatron_rl_patches.shared_prefix.plan import plan_shared_prefix

_packed = packed_ids


def _visible(plan, row):
    """The physical rows physical row `row` attends to, under the plan's rule."""
    return [j for j in range(row + 1) if row < plan.reach[j]]


@settings(deadline=None)  # torch ops per plan: milliseconds on a busy machine
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=7), min_size=1, max_size=6),
       st.integers(0, 3), st.integers(1, 4))
def test_each_logical_row_sees_exactly_its_own_samples_earlier_tokens(samples, padding, pad_to):
    tokens, cu = _packed(samples, padding)
    plan = plan_shared_prefix(tokens, cu, pad_to=pad_to)
    assert plan.physical_length % pad_to == 0
    assert plan.stats.logical_tokens == sum(map(len, samples))
    assert plan.stats.physical_tokens <= plan.stats.logical_tokens
    for i, sample in enumerate(samples):
        for k in range(len(sample)):
            row = int(plan.logical_rows[cu[i] + k])
            assert int(plan.tokens[row]) == sample[k] and int(plan.positions[row]) == k
            seen = sorted((int(plan.positions[j]), int(plan.tokens[j])) for j in _visible(plan, row))
            assert seen == [(p, sample[p]) for p in range(k + 1)]
    for top in (plan.segment_parents < 0).nonzero().flatten().tolist():  # no row sees past its subtree
        start = int(plan.segment_starts[top])
        for row in range(start, int(plan.reach[start])):
            assert min(_visible(plan, row)) >= start
    if padding:
        pad_rows = plan.logical_rows[cu[-1]:]
        assert int(pad_rows.min()) >= plan.physical_length - plan.padding_rows


def test_a_group_computes_its_prompt_once_and_its_last_row_serves_every_member():
    prompt = list(range(1, 41))
    samples = [prompt + [50 + i, 60 + i] for i in range(8)]
    tokens, cu = _packed(samples, padding=3)
    plan = plan_shared_prefix(tokens, cu, hints=[0] * 8)
    assert plan.stats.as_dict() == {"samples": 8, "logical_tokens": 336, "physical_tokens": 40 + 16,
                                    "saved_tokens": 280, "groups": 1, "shared_samples": 8, "alone": 0,
                                    "split_hints": 0, "padding_tokens": 3, "padding_rows": 3,
                                    "filler_rows": 0}
    last_prompt_rows = {int(plan.logical_rows[cu[i] + 39]) for i in range(8)}
    assert last_prompt_rows == {39}  # one row, eight targets (each sample's first response token)
    assert plan.physical_length == 56 + 3  # and each padding row its own, as packed
    assert plan.logical_rows[336:].tolist() == [56, 57, 58] and plan.padding_rows == 3


@settings(deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=0, max_size=4),
       st.lists(st.lists(st.integers(0, 1), min_size=0, max_size=5), min_size=0, max_size=3),
       st.lists(st.integers(0, 1), max_size=4), st.integers(1, 4), st.booleans())
def test_each_padding_row_is_computed_as_packed(samples, paddings, past, pad_to, once):
    """Padding sequences of any ids (empty ones too) and rows past cu_seqlens[-1] (one more sequence):
    each padding row on a physical row of its own, holding its id at its position in its sequence and
    seeing exactly that sequence's earlier rows; read by no sample; the stats count it. With
    `repeated_padding_once` a sequence of one repeated id is one row (its id, position 0) all its rows
    read; a sequence of varying ids is computed row by row all the same."""
    sequences = samples + paddings + ([past] if past else [])
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    cu = [0]
    for s in samples + paddings:
        cu.append(cu[-1] + len(s))
    plan = plan_shared_prefix(tokens, cu, samples=len(samples), pad_to=pad_to, repeated_padding_once=once)
    padding = [s for s in paddings if s] + ([past] if past else [])
    collapsed = [once and len(set(s)) == 1 for s in padding]
    rows = sum(1 if one else len(s) for s, one in zip(padding, collapsed))
    stats = plan.stats
    assert stats.padding_tokens == sum(map(len, padding)) and stats.padding_rows == rows
    assert 0 <= stats.filler_rows < pad_to and plan.padding_rows == rows + stats.filler_rows
    assert plan.physical_length == stats.physical_tokens + rows + stats.filler_rows
    assert plan.physical_length % pad_to == 0
    start = cu[len(samples)]
    read = plan.logical_rows[start:].tolist()
    assert len(set(read)) == rows and min(read, default=stats.physical_tokens) >= stats.physical_tokens
    for sequence, one in zip(padding, collapsed):
        for k, token in enumerate(sequence):
            row = int(plan.logical_rows[start + k])
            assert int(plan.tokens[row]) == token and int(plan.positions[row]) == (0 if one else k)
            seen = sorted((int(plan.positions[j]), int(plan.tokens[j])) for j in _visible(plan, row))
            assert seen == [(p, sequence[p]) for p in range(1 if one else k + 1)]
        start += len(sequence)


def test_repeated_padding_once_is_a_bool():
    with pytest.raises(TypeError, match="repeated_padding_once must be a bool, got 1"):
        plan_shared_prefix(torch.tensor([1, 2, 0, 0]), [0, 2, 4], samples=1, repeated_padding_once=1)


def test_claimed_groups_whose_prompts_differ_are_counted_and_split():
    samples = [[1, 2, 3, 4], [1, 2, 3, 5], [7, 8, 9, 4], [7, 8, 9, 5]]
    tokens, cu = _packed(samples)
    plan = plan_shared_prefix(tokens, cu, hints=[0, 0, 0, 0])
    assert plan.stats.groups == 2 and plan.stats.split_hints == 1


def test_sequences_past_samples_are_padding_never_shared():
    samples = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6]]
    tokens, cu = _packed(samples)
    plan = plan_shared_prefix(tokens, cu, samples=2)
    assert plan.stats.samples == 2 and plan.stats.shared_samples == 2
    assert plan.stats.logical_tokens == 8 and plan.stats.padding_tokens == 4
    # the padding sequence starts as the samples do, yet is computed on rows of its own, at its own positions
    assert plan.logical_rows[8:].tolist() == [5, 6, 7, 8] and plan.physical_length == 9
    assert plan.positions[5:].tolist() == [0, 1, 2, 3] and plan.tokens[5:].tolist() == [1, 2, 3, 6]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tokens": torch.tensor([1.0, 2.0]), "cu_seqlens": [0, 2]}, "integer dtype"),
    ({"tokens": [1, 2], "cu_seqlens": [0, 2]}, "torch.Tensor"),
    ({"tokens": torch.tensor([1, 2]), "cu_seqlens": [0, 2, 1]}, "never decrease"),
    ({"tokens": torch.tensor([1, 2]), "cu_seqlens": [0, 3]}, "within the 2"),
    ({"tokens": torch.tensor([1, 2]), "cu_seqlens": [0, 0, 2]}, "length 0"),
    ({"tokens": torch.tensor([1, 2]), "cu_seqlens": [0, 2], "samples": 2}, "samples=2"),
    ({"tokens": torch.tensor([1, 2]), "cu_seqlens": [0, 2], "pad_to": 0}, "pad_to"),
    ({"tokens": torch.tensor([1, 2]), "cu_seqlens": [0, 2], "min_shared": True}, "min_shared"),
    ({"tokens": torch.tensor([1, 2]), "cu_seqlens": [0, 2], "hints": [0, 1]}, "one entry per sample"),
    ({"tokens": torch.empty(2, dtype=torch.long, device="meta"), "cu_seqlens": [0, 2]}, "meta device"),
    ({"tokens": torch.tensor([1, 2]), "cu_seqlens": torch.tensor([0.0, 2.0])}, "1-D integer tensor"),
])
def test_bad_input_is_refused_by_name_and_the_tokens_untouched(kwargs, message):
    before = kwargs["tokens"].clone() if isinstance(kwargs["tokens"], torch.Tensor) else None
    with pytest.raises((ValueError, TypeError), match=message):
        plan_shared_prefix(**kwargs)
    if before is not None and before.device.type != "meta":
        assert torch.equal(kwargs["tokens"], before)


def test_the_fingerprint_tells_two_plans_apart():
    a = plan_shared_prefix(*_packed([[1, 2, 3], [1, 2, 4]]))
    b = plan_shared_prefix(*_packed([[1, 2, 3], [1, 5, 4]]))
    assert a.fingerprint() == plan_shared_prefix(*_packed([[1, 2, 3], [1, 2, 4]])).fingerprint()
    assert a.fingerprint() != b.fingerprint()


def test_the_packed_forms_of_the_tokens_and_boundaries_give_one_plan():
    samples = [[1, 2, 3, 4], [1, 2, 3, 5], [6, 7]]
    tokens, cu = _packed(samples, padding=2)
    flat = plan_shared_prefix(tokens, cu)
    for other in (plan_shared_prefix(tokens[None], torch.tensor(cu, dtype=torch.int32)),
                  plan_shared_prefix(tokens.to(torch.int32), tuple(cu))):
        assert torch.equal(other.tokens, flat.tokens) and torch.equal(other.logical_rows, flat.logical_rows)
    assert [g.members for g in flat.groups] == [(0, 1), (2,)] and flat.stats.alone == 1
    assert flat.stats.split_hints == 0  # no hints: nothing claimed
    # two claimed groups, each one prompt: nothing split
    assert plan_shared_prefix(tokens, cu, hints=["a", "a", "b"]).stats.split_hints == 0
    assert plan_shared_prefix(tokens, cu, min_shared=1).groups == flat.groups  # the default shares one token
    one = plan_shared_prefix(*_packed([[9, 1], [9, 2]]))
    assert one.stats.groups == 1 and one.groups[0].shared == 1
    assert plan_shared_prefix(tokens, cu, min_shared=4).stats.groups == 0  # the two share 3 tokens, fewer than 4


def test_no_padding_asks_for_no_padding_row_and_padding_alone_is_a_plan():
    tokens, cu = _packed([[1, 2, 3], [1, 2, 4]])
    plan = plan_shared_prefix(tokens, cu)
    assert plan.padding_rows == 0 and plan.physical_length == plan.stats.physical_tokens == 4
    padding = plan_shared_prefix(torch.tensor([7, 7, 7]), [0, 3], samples=0)
    assert padding.stats.samples == 0 and padding.stats.logical_tokens == 0 and padding.padding_rows == 3
    assert padding.logical_rows.tolist() == [0, 1, 2] and padding.tokens.tolist() == [7, 7, 7]
    empty = plan_shared_prefix(torch.empty(0, dtype=torch.long), [0])
    assert empty.physical_length == 0 and empty.tokens.dtype == torch.int64 and empty.groups == ()


@pytest.mark.parametrize(("tokens", "cu", "message"), [
    (torch.ones(2, 3, dtype=torch.long), [0, 3], r"\[T\] or \[1, T\]"),
    (torch.tensor([True, False]), [0, 2], "integer dtype"),
    (torch.tensor([1, 2]), torch.tensor([[0, 2]]), "1-D integer tensor"),
    (torch.tensor([1, 2]), torch.empty(2, dtype=torch.long, device="meta"), "1-D integer tensor"),
    (torch.tensor([1, 2]), [0, True], "a sequence of ints"),
    (torch.tensor([1, 2]), {0, 2}, "a sequence of ints"),
    (torch.tensor([1, 2]), [], "must start at 0"),
    (torch.tensor([1, 2]), [0, 1, 3], "within the 2"),
    (torch.tensor([1, 2]), [0, *range(1, 12)], r"got \[0, 1, 2, 3, 4, 5, 6, 7\]\.\.\."),
    (torch.tensor([1, 2]), [0, 1, 2, 3, 4, 5, 6, 7], r"got \[0, 1, 2, 3, 4, 5, 6, 7\]$"),  # eight: all, no ...
])
def test_malformed_boundaries_are_refused_by_name(tokens, cu, message):
    with pytest.raises((ValueError, TypeError), match=message):
        plan_shared_prefix(tokens, cu)


def test_the_fingerprint_reads_every_row():
    a = plan_shared_prefix(*_packed([[1, 2, 3], [1, 2, 4], [5, 6]]))
    last_token = plan_shared_prefix(*_packed([[1, 2, 3], [1, 2, 4], [5, 7]]))
    assert a.fingerprint() != last_token.fingerprint()
    assert a.fingerprint()[:2] == (6, 8) and 0 <= a.fingerprint()[2] < 2 ** 52


def _trie(samples):
    return len({tuple(s[:k + 1]) for s in samples for k in range(len(s))})


@settings(deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=9), min_size=1, max_size=9))
def test_the_physical_rows_are_the_samples_trie(samples):
    plan = plan_shared_prefix(*_packed(samples))
    assert plan.physical_length == plan.stats.physical_tokens == _trie(samples)
    parents, depths = plan.segment_parents, plan.segment_depths
    for segment, parent in enumerate(parents.tolist()):  # a parent before its children, one level above
        assert parent < segment and int(depths[segment]) == (0 if parent < 0 else int(depths[parent]) + 1)
        start = int(plan.segment_starts[segment])
        assert int(plan.reach[start]) == int(plan.reach[start:int(plan.segment_ends[segment])].max())


def test_a_multi_turn_tree_computes_each_turn_once():
    from kit.shared_prefix import tree_batch, trie_size

    batch = tree_batch(system=30, turns=((5, 9, 2), (4, 6, 3)), vocab=10 ** 6)  # no chance collisions
    plan = batch.plan()
    # the system prompt and the first user turn once, each first answer and its user turn once, then 6 answers
    assert plan.stats.physical_tokens == trie_size(batch.sequences) == 30 + 5 + 2 * (9 + 4) + 6 * 6
    assert plan.segment_depths.tolist() == [0, 1, 2, 2, 2, 1, 2, 2, 2, 0]  # the padding a segment of its own
    assert plan.stats.groups == 1 and plan.groups[0].members == tuple(range(6)) and plan.groups[0].shared == 35
    # one sample per turn: each turn's sample the prefix of the next: the longest samples' rows only
    per_turn = tree_batch(system=30, turns=((5, 9, 1), (4, 6, 1), (3, 3, 1)), per_turn=True, padding=0)
    planned = per_turn.plan()
    assert planned.physical_length == max(per_turn.lengths) and planned.stats.saved_tokens == 44 + 54
    for i, sample in enumerate(per_turn.sequences):  # a sample ending inside another reads its rows
        start = int(per_turn.cu_seqlens[i])
        assert planned.logical_rows[start:start + len(sample)].tolist() == list(range(len(sample)))


def test_grpo_batches_plan_one_level_as_before():
    """Depth 1: each group's prompt once, then each member's remainder, groups by their first member,
    samples alone whole: the layout of the one-level plan."""
    prompt_a, prompt_b = list(range(100, 140)), list(range(200, 230))
    samples = [prompt_a + [1, 5], [7, 8, 9], prompt_a + [2, 6, 6], prompt_b + [3], prompt_b + [4, 4], prompt_a + [9]]
    plan = plan_shared_prefix(*_packed(samples, padding=2), pad_to=4)
    want = prompt_a + [1, 5] + [2, 6, 6] + [9] + [7, 8, 9] + prompt_b + [3] + [4, 4]
    assert plan.tokens[:len(want)].tolist() == want and plan.stats.physical_tokens == len(want)
    assert [g.members for g in plan.groups] == [(0, 2, 5), (1,), (3, 4)]
    assert [g.shared for g in plan.groups] == [40, 0, 30]
    assert plan.segment_depths.tolist() == [0, 1, 1, 1, 0, 0, 1, 1, 0]


def test_min_shared_applies_per_branch():
    """A branch adding fewer than `min_shared` tokens to the segment above is not split off: its
    tokens go down into each child; a sample's own remainder is laid out whatever its length."""
    root = list(range(10, 16))  # 6 tokens all share
    samples = [root + [1, 2, 7], root + [1, 2, 8], root + [3, 9, 9, 9]]
    tokens, cu = _packed(samples)
    # min_shared 1: root, [1, 2] (2 tokens), [7], [8], [3, 9, 9, 9]
    assert plan_shared_prefix(tokens, cu).stats.physical_tokens == 6 + 2 + 1 + 1 + 4
    # min_shared 3: [1, 2] adds 2 < 3 tokens: not split off, each child computes it
    three = plan_shared_prefix(tokens, cu, min_shared=3)
    assert three.stats.physical_tokens == 6 + 3 + 3 + 4 and three.segment_depths.tolist() == [0, 1, 1, 1]
    # min_shared 7: the root (6) is shared no more; its tokens go down: the first two share 6 + 2 = 8
    seven = plan_shared_prefix(tokens, cu, min_shared=7)
    assert seven.stats.physical_tokens == 8 + 1 + 1 + 10 and [g.shared for g in seven.groups] == [8, 0]
    assert plan_shared_prefix(tokens, cu, min_shared=9).stats.physical_tokens == 9 + 9 + 10  # all whole
    # a sample ending inside a branch too short to share: its own rows, no other's
    short = [root[:3], root + [1]]
    plan = plan_shared_prefix(*_packed(short), min_shared=4)
    assert plan.stats.physical_tokens == 3 + 7 and plan.logical_rows[:3].tolist() == [0, 1, 2]
    assert plan_shared_prefix(*_packed(short), min_shared=3).stats.physical_tokens == 7


def test_levels_caps_the_depth_one_level_a_groups_longest_common_prefix():
    from kit.shared_prefix import tree_batch

    batch = tree_batch(system=30, turns=((5, 9, 2), (4, 6, 3)), vocab=10 ** 6)
    one = batch.plan(levels=1)
    assert one.stats.physical_tokens == 35 + 6 * (9 + 4 + 6) and int(one.segment_depths.max()) == 1
    assert batch.plan(levels=2).stats.physical_tokens == batch.plan().stats.physical_tokens
    with pytest.raises(ValueError, match="levels must be an int >= 1"):
        batch.plan(levels=0)
