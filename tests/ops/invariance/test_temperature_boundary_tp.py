"""The smallest temperature at TP = 2 (issue 63 item 3), in the TP = 2 invariance world: every op over
its vocabulary shard gives the τ → 0 limit in both modes, where the ranks' sums move to the global max
(the cases: tests/ops/checks/test_temperature_boundary.py's tp_checks)."""
from __future__ import annotations

import pytest
from test_temperature_boundary import check_limit  # tests/ops/checks, on sys.path (this folder's conftest)

pytestmark = pytest.mark.multirank


def test_at_tp2_every_op_at_the_smallest_temperature_gives_the_limit(invariance_world):
    ranks = invariance_world.results(2, "tiny_temperature")
    for results in ranks:
        assert len(results) == 8
        for (name, _), out in results.items():
            check_limit(name, out)
