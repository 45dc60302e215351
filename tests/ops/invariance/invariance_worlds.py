"""One gloo world per size for every multi-rank invariance check (spawning 8 ranks on 2 cores is
the slow part): a size's world runs the tensor-parallel checks and, at CP = 2, the context-parallel
layout checks, once per session (the `invariance_world` fixture in this folder's conftest)."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.testing.multirank import run_multirank


def every_check(rank: int, world: int) -> dict[str, Any]:
    """This rank's results of each check module that runs at this world size."""
    import test_invariant_layouts  # this folder's modules (pytest puts the folder on sys.path)
    import test_invariant_native
    import test_invariant_tp
    import test_invariant_vocab_limit
    import test_temperature_boundary  # tests/ops/checks (on sys.path: this folder's conftest)

    results = {"tp": test_invariant_tp.tp_checks(rank, world)}
    if world == 2:
        results["vocab_limit"] = test_invariant_vocab_limit.limit_checks(rank, world)
        results["native"] = test_invariant_native.native_checks(rank, world)
        results["tiny_temperature"] = test_temperature_boundary.tp_checks(rank, world)
    if world == test_invariant_layouts.CP:
        results["layouts"] = test_invariant_layouts.layout_checks(rank, world)
    return results


class Worlds:
    """Results by world size, each world spawned on first use."""

    def __init__(self) -> None:
        self._results: dict[int, list[dict[str, Any]]] = {}

    def results(self, size: int, part: str) -> list[Any]:
        if size not in self._results:
            self._results[size] = run_multirank(every_check, size, timeout=600)
        return [rank_results[part] for rank_results in self._results[size]]
