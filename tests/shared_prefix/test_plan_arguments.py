"""plan_shared_prefix reads its hints by value (a tensor of claimed groups counts the split its list
counts; an unhashable hint named), bounds `pad_to` (no padding larger than the stream: 2**62 was
torch's storage overflow, 2**64 an overflow from repeat()) and refuses a negative id by name (the
embedding's bare IndexError otherwise) — the tokens untouched."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl_patches.shared_prefix import plan_shared_prefix

A, B = [1, 2, 3, 4, 9], [7, 8, 6, 5, 9]
TOKENS = torch.tensor(A + [10] + A + [11] + B + [12] + B + [13])
CU = [0, 6, 12, 18, 24]


@pytest.mark.parametrize("hints", [
    [0, 0, 0, 0], torch.tensor([0, 0, 0, 0]), list(torch.tensor([0, 0, 0, 0])), np.zeros(4, dtype=np.int64).tolist(),
    (0, 0, 0, 0)])
def test_a_claimed_group_holding_two_prompts_counts_one_split_whatever_holds_the_hints(hints):
    assert plan_shared_prefix(TOKENS, CU, hints=hints).stats.split_hints == 1


def test_hints_that_agree_with_the_tokens_count_no_split():
    assert plan_shared_prefix(TOKENS, CU, hints=torch.tensor([3, 3, 5, 5])).stats.split_hints == 0


@pytest.mark.parametrize(("hints", "error", "message"), [
    ([[0], [0], [1], [1]], TypeError, r"hints\[0\] is a list .*not hashable"),
    ([0, 0, {"g": 1}, 1], TypeError, r"hints\[2\] is a dict .*not hashable"),
    ([0, 0, 1, torch.tensor([1, 2])], ValueError, r"hints\[3\] is a tensor of 2 values"),
    (torch.zeros(2, 2), ValueError, "hints must be one value per sample, a 1-D tensor"),
    (torch.zeros(3), ValueError, r"one entry per sample \(4\), got 3"),
    (7, TypeError, "hints must be a sequence"),
    ("abcd", TypeError, "hints must be a sequence"),
])
def test_hints_that_are_not_one_value_per_sample_are_refused_by_name(hints, error, message):
    with pytest.raises(error, match=message):
        plan_shared_prefix(TOKENS, CU, hints=hints)


@pytest.mark.parametrize("pad_to", [2 ** 62, 2 ** 64, 2 ** 17])
def test_a_pad_to_whose_padding_outgrows_the_stream_is_refused_by_name(pad_to):
    with pytest.raises(ValueError, match=f"pad_to={pad_to} would pad the physical stream by up to"):
        plan_shared_prefix(TOKENS, CU, pad_to=pad_to)


def test_a_tensor_parallel_pad_to_and_one_past_a_short_stream_still_plan():
    assert plan_shared_prefix(TOKENS, CU, pad_to=8).physical_length % 8 == 0
    assert plan_shared_prefix(TOKENS, CU, pad_to=64).physical_length == 64  # past the 24 tokens, within 65,536


@pytest.mark.parametrize(("row", "where"), [(0, "sequence 0"), (13, "sequence 2"), (25, "the padding past")])
def test_a_negative_id_is_refused_by_name_with_its_row(row, where):
    tokens = torch.cat([TOKENS, torch.tensor([0, 0])])
    tokens[row] = -1
    given = tokens.clone()
    with pytest.raises(ValueError, match=rf"negative id \(-1\) at packed row {row} \({where}"):
        plan_shared_prefix(tokens, CU)
    assert torch.equal(tokens, given)
