"""A sharing plan as a reader prints it (issue 119 item 8): `print(plan)` is one line of figures, not
every tensor, and `plan.tree()` shows every segment at every depth (`plan.groups`: the top level
only), each with the rows it computes and the samples holding it: the path of segments under a
sample spells that sample's tokens, in its positions, and nothing else."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.shared_prefix import packed_ids

from megatron_rl_patches.shared_prefix.plan import plan_shared_prefix
from megatron_rl_patches.shared_prefix.plan_summary import samples_text

SYSTEM = [1, 2, 3, 4, 5, 6]
BRANCHING = [SYSTEM + [7, 8, 9], SYSTEM + [7, 8, 10, 11], SYSTEM + [12, 13], [20, 21]]


_packed = packed_ids


def _paths(nodes, above=()):
    """{sample: the nodes from the top down to the deepest holding it}."""
    found = {}
    for node in nodes:
        for sample in node.samples:
            found.setdefault(sample, (*above, node))
        for sample, path in _paths(node.children, (*above, node)).items():
            found[sample] = path
    return found


def test_print_shows_one_line_of_figures_not_the_tensors():
    # two padding rows of one id: each its own row as packed, then 3 filling to pad_to = 4 (15 + 2 + 3)
    plan = plan_shared_prefix(*_packed(BRANCHING, padding=2), samples=4, pad_to=4)
    assert str(plan) == repr(plan) == (
        "SharedPrefixPlan(4 samples: 3 in 1 group sharing a prefix, 1 alone; tokens 29 packed, 15 computed "
        "(1.93x fewer), 5 padding rows; segments by depth: 2, 2, 2)")
    once = plan_shared_prefix(*_packed(BRANCHING, padding=2), samples=4, pad_to=4, repeated_padding_once=True)
    assert repr(once).endswith("15 computed (1.93x fewer), 1 padding row; segments by depth: 2, 2, 2)")  # 15 + 1
    unpadded = plan_shared_prefix(*_packed(BRANCHING))
    assert repr(unpadded).endswith("15 computed (1.93x fewer), 0 padding rows; segments by depth: 2, 2, 2)")
    flat = plan_shared_prefix(*_packed(BRANCHING), levels=1)
    assert repr(flat) == (
        "SharedPrefixPlan(4 samples: 3 in 1 group sharing a prefix, 1 alone; tokens 29 packed, 17 computed "
        "(1.71x fewer), 0 padding rows; segments by depth: 2, 3)")
    alone = plan_shared_prefix(*_packed([[1, 2], [3], [4, 5, 6]]))
    assert repr(alone) == ("SharedPrefixPlan(3 samples: 0 in 0 groups sharing a prefix, 3 alone; tokens 6 packed, "
                           "6 computed (1.00x fewer), 0 padding rows; segments by depth: 3)")
    assert "tensor" not in repr(plan) and "\n" not in repr(plan)


def test_the_tree_holds_every_depth_and_each_segment_its_rows_and_samples():
    plan = plan_shared_prefix(*_packed(BRANCHING, padding=2), samples=4, pad_to=4)
    top, alone = plan.tree()
    assert [g.members for g in plan.groups] == [(0, 1, 2), (3,)]  # the top level only
    assert (top.start, top.length, top.position, top.samples) == (0, 6, 0, (0, 1, 2))
    turn, other = top.children
    assert (turn.start, turn.length, turn.position, turn.samples) == (6, 2, 6, (0, 1))
    assert [(c.start, c.length, c.position, c.samples, c.children) for c in turn.children] == [
        (8, 1, 8, (0,), ()), (9, 2, 8, (1,), ())]
    assert (other.start, other.length, other.position, other.samples, other.children) == (11, 2, 6, (2,), ())
    assert (alone.start, alone.length, alone.samples, alone.children) == (13, 2, (3,), ())  # padding: no node
    assert str(top) == ("rows 0-5 (6 tokens from position 0): samples 0-2\n"
                        "  rows 6-7 (2 tokens from position 6): samples 0-1\n"
                        "    row 8 (1 token from position 8): sample 0\n"
                        "    rows 9-10 (2 tokens from position 8): sample 1\n"
                        "  rows 11-12 (2 tokens from position 6): sample 2")
    flat = plan_shared_prefix(*_packed(BRANCHING), levels=1).tree()
    assert [len(node.children) for node in flat] == [3, 0]  # one level: each member's rest whole
    assert [c.length for c in flat[0].children] == [3, 4, 2]


@settings(deadline=None, max_examples=60)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=6),
       st.integers(0, 3), st.integers(1, 4), st.sampled_from([None, 1, 2]))
def test_each_samples_path_spells_its_tokens_and_the_segments_tile_the_computed_rows(samples, padding, pad_to,
                                                                                   levels):
    tokens, cu = _packed(samples, padding)
    plan = plan_shared_prefix(tokens, cu, pad_to=pad_to, levels=levels)
    nodes = plan.tree()
    paths = _paths(nodes)
    assert sorted(paths) == list(range(len(samples)))
    for sample, path in paths.items():
        spelled, position = [], 0
        for node in path:
            assert node.position == position  # each segment continues its parent where it ended
            spelled += plan.tokens[node.start:node.start + node.length].tolist()
            position += node.length
        # its tokens, its last in the deepest segment (a sample that is another's prefix ends inside it)
        assert spelled[:len(samples[sample])] == samples[sample]
        assert len(spelled) - path[-1].length < len(samples[sample]) <= len(spelled)
        assert all(set(child.samples) <= set(node.samples) for node in path for child in node.children)

    def rows(node):
        return [*range(node.start, node.start + node.length), *[r for c in node.children for r in rows(c)]]

    covered = sorted(r for node in nodes for r in rows(node))
    assert covered == list(range(plan.stats.physical_tokens))  # every computed row once, padding none


@pytest.mark.parametrize(("samples", "said"), [((3,), "sample 3"), ((0, 1, 2, 3), "samples 0-3"),
                                               ((0, 2, 3, 7), "samples 0, 2-3, 7"), ((), "samples ")])
def test_samples_are_said_as_runs(samples, said):
    assert samples_text(samples) == said
