"""Bitwise equality with the results recorded from the reference commit (golden_cases.py): the
validation added for bad inputs and the top-k OPD split (topk_logprobs + topk_kl) change no bit."""
from __future__ import annotations

import pytest
import torch
from kit import golden_cases

RECORDED = torch.load(golden_cases.DATA / "golden_ops.pt")
NOW = golden_cases.cases()


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_bitwise_equal_to_the_reference(key):
    golden_cases.assert_same(RECORDED[key], NOW[key], key)
