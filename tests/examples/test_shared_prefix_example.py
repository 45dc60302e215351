"""The worked shared-prefix example (examples/shared_prefix_cpu.py). Its command runs as pasted, with
what it prints and no warning, in the docs test (docs/shared-prefix.md's block: tests/docs/doc_shell.py):
the micro-batches fit their budget in computed tokens, the prompt is computed once per micro-batch,
and the training step's loss and every gradient equal the step with each sample packed whole. Here,
in process: the saving said in words that hold when nothing is saved, and a budget too small for one
sample refused by name."""
from __future__ import annotations

import pytest
from kit.examples import load_example

pytestmark = [pytest.mark.megatron, pytest.mark.reader_facing]  # main and newest lanes



@pytest.fixture(scope="module")
def example():
    pytest.importorskip("megatron.core")
    return load_example("shared_prefix_cpu")


def test_the_saving_is_said_in_words_that_hold_when_nothing_is_saved(example):
    assert example.fewer(329, 1673) == "5.1x fewer"
    assert example.fewer(164, 400) == "2.4x fewer"
    assert example.fewer(400, 400) == "the same: no micro-batch holds two samples of one prompt"
    assert example.fewer(390, 400) == "10 fewer, 1.03x"  # never "1.0x fewer"


def test_a_budget_smaller_than_a_sample_is_refused(example):
    with pytest.raises(ValueError, match=r"more than max_tokens=20"):
        example.main(["--max-tokens", "20"])
