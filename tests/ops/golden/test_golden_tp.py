"""Bitwise equality of the vocab-parallel ops on 2 gloo ranks with the results recorded from the
reference commit (golden_cases.tp_cases): the cross-rank combine of every op changes no bit (the
products in a fixed order, MKL's code path pinned, the results per CPU capability: docs/testing.md,
"Golden results")."""
from __future__ import annotations

import pytest
from kit import golden_cases

pytestmark = pytest.mark.multirank


def test_tp2_bitwise_equal_to_the_reference():
    recorded, bitwise = golden_cases.recorded(golden_cases.TP)
    now = golden_cases.pinned(golden_cases.tp_cases, 2)  # MKL's code path pinned
    for rank, (before_rank, after_rank) in enumerate(zip(recorded, now)):
        for key, before in before_rank.items():
            golden_cases.assert_same(before, after_rank[key], (rank, key), bitwise)
