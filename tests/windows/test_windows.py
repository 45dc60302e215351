"""Accumulation windows (issue 21) on real megatron-core, 2 gloo ranks: every scenario of the lane
runs in ONE spawn (windows_scenarios.run_all, cached for the session); each test asserts on it.

Without the fix the reproduction cases fail (AssertionError, or gradients that differ from the
synchronous reference); with `grad_windows` alone, and with `accumulation_window` alone, every
case equals the reference bitwise (same reduction, same order), per window and after the
optimizer steps."""
from __future__ import annotations

import pytest
import torch
from kit import windows_scenarios as ws

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

FIXED = ("patch", "window")


@pytest.fixture(scope="session")
def lane() -> list[dict]:
    return run_multirank(ws.run_all, 2, timeout=400)


def _version(lane: list[dict]) -> tuple[int, int]:
    major, minor = lane[0]["version"].split(".")[:2]
    return int(major), int(minor)


def _max_diff(result, reference) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(result["grads"], reference["grads"]))


def _layouts(group: str, case: str) -> list:
    """The layout(...) marker of a scenario (docs/layouts.md): the pipelines, the distributed optimizer."""
    if group != "dp":
        return [layouts.mark("pp2", "vpp2") if group == "vpp" else layouts.mark("pp2")]
    return [layouts.mark("distopt")] if ws.DP_CASES[case][1].get("use_distributed_optimizer") else []


@pytest.mark.parametrize("group,case", [pytest.param(group, name, marks=_layouts(group, name))
                                        for group, names in (("dp", ws.DP_CASES), ("pp", ws.PP_CASES),
                                                             ("vpp", ws.PP_CASES)) for name in names])
@pytest.mark.parametrize("mode", FIXED)
def test_fixed_equals_the_synchronous_reference(lane, group, case, mode):
    for rank, out in enumerate(lane):
        modes = out[group][case]
        ws.assert_equal(modes[mode], modes["ref"], f"rank {rank} {group} {case} {mode}")


def test_reproduction_without_the_fix(lane):
    """The issue's table: what upstream does with the same loops (per version)."""
    dp = lane[0]["dp"]
    crash = "Cannot set grad twice" if _version(lane) < (0, 16) else "Communication call has not been issued"
    crashes = [name for name, modes in dp.items() if isinstance(modes["none"], str)]
    for name in crashes:
        assert crash in dp[name]["none"], (name, dp[name]["none"])
    assert "mb2,1" not in crashes  # several microbatches in ONE call: upstream is right
    ws.assert_equal(dp["mb2,1"]["none"], dp["mb2,1"]["ref"], "mb2,1 unpatched")
    if _version(lane) < (0, 16):  # params_with_grad: every window of >= 2 calls fails in its 2nd call
        assert set(crashes) == set(ws.DP_CASES) - {"mb2,1"}
        return
    assert {"2,1", "mb-change", "unused-param"} <= set(crashes)
    ws.assert_equal(dp["2,2"]["none"], dp["2,2"]["ref"], "2,2 unpatched")  # steady windows are right
    for name in ("2,3", "1,2", "sgd", "adam", "distopt-adam", "param-gather-adam"):  # silently wrong
        for out in lane:
            modes = out["dp"][name]
            assert not isinstance(modes["none"], str), (name, modes["none"])
            assert _max_diff(modes["none"], modes["ref"]) > 1e-2, name
            assert torch.equal(modes["none"]["grads"][0], modes["ref"]["grads"][0])  # the first window is right


def test_reproduction_pipelined(lane):
    """PP = 2 (DP = 1: a premature reduce is numerically harmless there, a missing one is not)."""
    for group in ("pp", "vpp"):
        modes = lane[0][group]["2,1"]
        if _version(lane) < (0, 16):
            assert modes["none"] == ws.PP_HANG  # not run: it would hang
        else:
            assert isinstance(modes["none"], str) and "Communication call has not been issued" in modes["none"]


def test_train_step_keeps_megatrons_overlap(lane):
    """finalize_model_grads_func set (Megatron-LM's train_step): the patch changes nothing, the
    reduce still starts from a backward hook of the last microbatch once the counts are known;
    split windows reduce at finish_grad_sync."""
    for out in lane:
        dispatch = out["dispatch"]
        assert dispatch["patch"] == dispatch["none"]
        assert dispatch["patch"][-2:] == [(4, "backward"), (6, "backward")]  # 2 microbatches per step
        assert dispatch["patch-split"] == [(2, "finish"), (4, "finish")]


def test_no_added_collective_or_host_sync(lane):
    for out in lane:
        cost = out["cost"]
        assert cost["patch"] == cost["window"] == cost["ref"], cost
        assert not any(key in cost["patch"] for key in ("item", "tolist", "synchronize")), cost
        if not isinstance(cost["none"], str):
            assert cost["none"] == cost["patch"]


def test_window_semantics(lane):
    """Nesting: only the outermost exit ends the block; the reduce waits for the next finish (its
    arguments decide it), the chunk deferring until then, and a block opened before it joins. An
    exception inside: nothing in flight, nothing shadowed, no counts; the next windows equal the
    reference. No backward: nothing started. Opening a window while a reduce is in flight: a named
    error. A finish with an argument upstream does not take: its TypeError, the window unchanged."""
    clean = {"in_flight": False, "shadowed": False, "counts": 0}
    deferring = {"in_flight": False, "shadowed": True, "counts": 0}
    for out in lane:
        sem = out["semantics"]
        assert sem["after_inner_exit"] == sem["after_outer_exit"] == sem["after_rejoin"] == deferring
        assert "not_an_argument" in sem["bad_finish"] and sem["after_bad_finish"] == deferring
        assert sem["after_finalize"] == clean
        assert sem["open_in_flight"].startswith("AccumulationWindowError")
        assert torch.equal(sem["nested"], sem["ref"]["grads"][0])
        assert sem["after_exception"] == clean and sem["after_no_backward"] == clean
        ws.assert_equal(sem["exception_then"], sem["ref2"], "after an exception")
        ws.assert_equal(sem["no_backward_then"], sem["ref2"], "after a window with no backward")


@layouts.mark("distopt")
def test_reentrant_train_with_changing_microbatch_counts(lane):
    for out in lane:
        patched, reference = out["reentry"]["patched"], out["reentry"]["ref"]
        assert not isinstance(patched, str), patched
        for got, want in zip(patched, reference):
            for a, b in zip(got["grads"], want["grads"]):
                assert torch.equal(a, b)
            for a, b in zip(got["losses"], want["losses"]):
                assert torch.equal(a, b)


def test_accumulation_window_refuses_a_non_ddp_model():
    from megatron_rl_patches import accumulation_window

    with pytest.raises(TypeError, match="DistributedDataParallel"):
        with accumulation_window(torch.nn.Linear(2, 2)):
            pass
    with pytest.raises(TypeError, match="non-empty list"):
        with accumulation_window([]):
            pass


def test_grad_windows_is_in_the_default_set():
    from megatron_rl_patches.integrations import all_patches
    from megatron_rl_patches.integrations.megatron.patches import SCHEDULE_FUNCTIONS, SCHEDULES

    targets = {patch.target for patch in all_patches() if patch.name == "grad_windows"}
    assert targets == {f"{SCHEDULES}:{name}" for name in SCHEDULE_FUNCTIONS}
