"""The multi-turn shared-prefix example (examples/shared_prefix_multi_turn.py, issue 119 item 9). Its
command runs as pasted, with what it prints and no warning, in the docs test (docs/shared-prefix.md's
block: tests/docs/doc_shell.py). Here, in process at another shape: the tokens each way computes are
the trace's own arithmetic (one level: each group's longest common prefix once, then every
sample's rest; every level: each distinct run of turns once), and each way's loss and every gradient
equal the samples packed whole by megatron-core."""
from __future__ import annotations

import pytest
from kit.examples import load_example

pytestmark = [pytest.mark.megatron, pytest.mark.reader_facing]  # main and newest lanes

SYSTEM, USER, ASSISTANT = 10, 3, 5


@pytest.fixture(scope="module")
def found():
    pytest.importorskip("megatron.core")
    example = load_example("shared_prefix_multi_turn")
    assert example.BRANCHES == (1, 2, 2)  # the arithmetic below is this trace's
    return example.main(["--system", str(SYSTEM), "--user", str(USER), "--assistant", str(ASSISTANT)])["found"]


def test_each_way_computes_the_traces_own_tokens(found):
    turn = USER + ASSISTANT
    longest = SYSTEM + 3 * turn
    branching, per_turn = found
    common = SYSTEM + turn + USER  # turn 2's user message is asked once, before its answers branch
    assert (branching["samples"], branching["packed"]) == (4, 4 * longest)
    assert branching["one level"]["computed"] == common + 4 * (longest - common)
    assert branching["every level"]["computed"] == common + 2 * (ASSISTANT + USER) + 4 * ASSISTANT
    assert (per_turn["samples"], per_turn["packed"]) == (3, 3 * SYSTEM + 6 * turn)
    shortest = SYSTEM + turn  # a sample per turn: the first is a prefix of the others
    assert per_turn["one level"]["computed"] == shortest + turn + 2 * turn
    assert per_turn["every level"]["computed"] == longest  # every token of the trajectory once
    tree = branching["every level"]["plan"].tree()
    assert [len(tree), len(tree[0].children), [len(c.children) for c in tree[0].children]] == [1, 2, [2, 2]]


def test_each_way_is_exact_against_the_samples_packed_whole(found):
    for case in found:
        for way in ("one level", "every level"):
            assert abs(case[way]["loss"] - case["whole_loss"]) < 1e-6, (case["name"], way)
            assert case[way]["worst"] < 2e-6, (case["name"], way, case[way]["worst"])
