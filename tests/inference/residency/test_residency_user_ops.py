"""Released weights behave like weights: everything user code does with a swap/stream teacher
between forwards (reductions, clone, cat, numpy, state_dict, torch.save then a resident load,
deepcopy, load_state_dict, .double(), .to()) runs in a fresh process (residency_user_ops.py), so
a segfault fails the test, and every value must equal the resident build's."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_rl_patches.testing.fresh_process import run_with_patches

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]  # the repository root
MODES = ("swap", "stream")


@pytest.fixture(scope="module")
def fresh_runs(tmp_path_factory):
    """{mode: the fresh process's results, or its failure}: the two independent processes started
    together (each a fresh interpreter importing torch and megatron-core), not one after the other."""
    folders = {mode: tmp_path_factory.mktemp(mode) for mode in MODES}

    def run(mode: str):
        try:
            return run_with_patches(Path(__file__).with_name("residency_user_ops.py"), folders[mode] / f"{mode}.pt",
                                    pythonpath=[ROOT], patches="")
        except AssertionError as failure:  # raised by the mode's own test
            return failure

    with ThreadPoolExecutor(len(MODES)) as pool:
        return dict(zip(MODES, pool.map(run, MODES)))


@pytest.mark.parametrize("residency", MODES)
def test_user_operations_between_forwards_in_a_fresh_process(fresh_runs, residency):
    results = fresh_runs[residency]
    if isinstance(results, AssertionError):
        raise results
    results.pop("status")
    assert len(results) == 16
    failed = {check: outcome for check, outcome in results.items() if outcome is not True}
    assert not failed
