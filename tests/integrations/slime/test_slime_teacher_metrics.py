"""slime's train-side `teacher/...` figures (`integrations.slime.opd.log_figures`) in one
process: handed to slime's `gather_log_data("teacher", args, rollout_id, figures)` (stood in,
recording its calls) on the ranks slime logs from, tensor-parallel rank 0 of the last pipeline
stage, as a copy; nothing on the other ranks, nor without figures. slime's real function: the slime
lane (test_slime_opd_rollout_scores_lane.py)."""
from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is missing")

from megatron.core import mpu  # noqa: E402

from megatron_rl_patches.integrations.slime.opd import log_figures  # noqa: E402


@pytest.fixture
def gathered(monkeypatch):
    """slime's `gather_log_data` stood in: the calls it got."""
    calls: list[tuple] = []
    utils = types.ModuleType("slime.observability.train_metric_utils")
    utils.gather_log_data = lambda *args: calls.append(args)
    for name in ("slime", "slime.observability"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, utils.__name__, utils)

    def at(tp_rank: int, last: bool) -> None:
        monkeypatch.setattr(mpu, "get_tensor_model_parallel_rank", lambda: tp_rank)
        monkeypatch.setattr(mpu, "is_pipeline_last_stage", lambda *a, **k: last)

    return calls, at


def test_the_logging_rank_hands_a_copy_to_slimes_gather(gathered):
    calls, at = gathered
    at(0, True)
    args, figures = types.SimpleNamespace(), {"samples": 4.0, "collect_wait_s": 0.5}
    log_figures(7, args, figures)
    ((prefix, got_args, rollout_id, logged),) = calls
    assert (prefix, got_args, rollout_id) == ("teacher", args, 7)
    assert logged == figures and logged is not figures  # slime's gather may change what it is given


@pytest.mark.parametrize(("tp_rank", "last"), [(1, True), (0, False), (1, False)])
def test_the_other_ranks_and_no_figures_log_nothing(gathered, tp_rank, last):
    calls, at = gathered
    at(tp_rank, last)
    log_figures(7, types.SimpleNamespace(), {"samples": 4.0})
    at(0, True)
    log_figures(7, types.SimpleNamespace(), None)
    assert calls == []
