"""Released weights behave like weights: everything user code does with a swap/stream teacher
between forwards (reductions, clone, cat, numpy, state_dict, torch.save then a resident load,
deepcopy, load_state_dict, .double(), .to()) runs in a fresh process (residency_user_ops.py), so
a segfault fails the test, and every value must equal the resident build's."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl_patches.testing.fresh_process import run_with_patches

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]  # the repository root


@pytest.mark.parametrize("residency", ["swap", "stream"])
def test_user_operations_between_forwards_in_a_fresh_process(tmp_path, residency):
    results = run_with_patches(Path(__file__).with_name("residency_user_ops.py"), tmp_path / f"{residency}.pt",
                               pythonpath=[ROOT], patches="")
    results.pop("status")
    assert len(results) == 16
    failed = {check: outcome for check, outcome in results.items() if outcome is not True}
    assert not failed
