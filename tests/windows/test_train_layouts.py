"""Re-entrant train() (docs/layouts.md row F1) and accumulation windows (row F2) at every parallel
layout, on real megatron-core, 2 gloo ranks, ONE spawn for the module (train_layouts.run_all).

F1: three rollouts of the stand-in slime train() through `reentrant_train` equal, bit for bit (every
step's losses and main grads), the by-hand control that resets the config's sync functions and the
hooks between rollouts; F2: windows of 1, 2, 3 schedule calls with Megatron's Adam, through
`grad_windows` and through `accumulation_window`, equal the synchronous reference bit for bit (every
window's reduced gradients, the parameters after the steps). Negative controls at every layout:
upstream's second train() call asserts, upstream's windows of 2 calls then 1 crash, and a window
with one microbatch fewer gives other parameters (the comparison sees it)."""
from __future__ import annotations

import pytest
import torch
from kit import train_layouts as tl
from kit import windows_scenarios as ws

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]


@pytest.fixture(scope="module")
def lane() -> list[dict]:
    return run_multirank(tl.run_all, 2, timeout=400)


def _layouts(feature: str) -> list:
    return [pytest.param(name, marks=layouts.mark(name)) for name, layout in tl.LAYOUTS.items()
            if feature in layout.features]


def _results(lane: list[dict], name: str, feature: str) -> list[dict]:
    if "skipped" in lane[0][name]:
        pytest.skip(lane[0][name]["skipped"])
    return [out[name][feature] for out in lane]


@pytest.mark.parametrize("layout", _layouts("F1"))
def test_reentrant_train_matches_the_by_hand_control(lane, layout):
    for rank, out in enumerate(_results(lane, layout, "F1")):
        patched, control = out["patched"], out["control"]
        assert not isinstance(patched, str), f"rank {rank}: {patched}"
        assert len(patched) == len(control) == tl.ROLLOUTS
        for got, want in zip(patched, control):
            for key in ("losses", "grads"):
                assert len(got[key]) == len(want[key]) == tl.ROLLOUT_STEPS
                for a, b in zip(got[key], want[key]):
                    assert torch.equal(a, b), (rank, key, got["rollout_id"], (a - b).abs().max())
        assert torch.equal(out["params"]["patched"], out["params"]["control"]), f"rank {rank}: parameters differ"
        assert all(g.abs().sum() > 0 for result in patched for g in result["grads"])  # every step learned
        assert not torch.equal(patched[0]["grads"][0], patched[1]["grads"][0])  # rollouts differ
        # negative control: upstream's second call stops at its own first install
        assert out["unpatched"].startswith("AssertionError") and "no_sync_func must be None" in out["unpatched"]
    has_loss = [bool(out["patched"][0]["losses"][0].numel()) for out in _results(lane, layout, "F1")]
    assert has_loss == ([False, True] if layout in ("pp2", "vpp2") else [True, True])  # the last stage's


@pytest.mark.parametrize("layout", _layouts("F2"))
@pytest.mark.parametrize("mode", ["patch", "window"])
def test_window_equals_the_synchronous_reference(lane, layout, mode):
    for rank, out in enumerate(_results(lane, layout, "F2")):
        ws.assert_equal(out[mode], out["ref"], f"rank {rank} {layout} {mode}")


@pytest.mark.parametrize("layout", _layouts("F2"))
def test_windows_negative_controls(lane, layout):
    """Upstream crashes on 2 calls then 1 (0.13-0.15 `Cannot set grad twice`, later `Communication
    call has not been issued`); one microbatch fewer moves the parameters."""
    for rank, out in enumerate(_results(lane, layout, "F2")):
        assert isinstance(out["none"], str) and out["none"].startswith("AssertionError"), out["none"]
        assert "Cannot set grad twice" in out["none"] or "Communication call has not been issued" in out["none"]
        assert not isinstance(out["dropped"], str), out["dropped"]
        assert (out["dropped"]["params"] - out["ref"]["params"]).abs().max() > 1e-3, f"rank {rank}"


@pytest.mark.parametrize("layout", _layouts("F2"))
def test_each_layout_runs_what_it_names(lane, layout):
    """The reference run of each layout: what makes it that layout, read off the model."""
    for rank, out in enumerate(_results(lane, layout, "F2")):
        facts = out["facts"]
        shapes, with_grad = facts["shapes"], facts["with_grad"]
        output = next(shape for name, shape in shapes.items() if name.endswith("output_layer.weight"))
        assert output[0] == (32 if layout in ("tp2", "sp") else 64)  # vocabulary-parallel rows
        assert (facts["sequence_parallel"] > 0) == (layout == "sp")
        assert facts["rows"] == (8 if layout.startswith("cp2") else 16)  # a context-parallel rank's half
        assert facts["dtypes"] == (["torch.bfloat16"] if layout == "bf16" else ["torch.float32"])
        if layout == "bf16":  # Megatron's mixed-precision optimizer: fp32 main parameters
            assert facts["optimizers"] == ["Float16OptimizerWithFloat16Params"], facts["optimizers"]
        experts = {name.split("local_experts.")[1].split(".")[0] for name in shapes if "local_experts." in name}
        assert experts == ({"0", "1"} if layout == "ep2" else set())  # 2 of 4 experts on each rank
        assert any(name.startswith("mtp.") for name in with_grad) == (layout == "mtp")
        calls = 2 if layout == "recompute" else 1  # a full recompute runs each layer again in backward
        assert facts["layers"] == 2 and facts["layer_calls_per_microbatch"] == calls * facts["layers"], facts
        # every parameter learned in the last step (an expert no token was routed to excepted)
        dense = [name for name in shapes if "local_experts." not in name]
        assert set(dense) <= set(with_grad), f"rank {rank}: {sorted(set(dense) - set(with_grad))} got no gradient"
        assert (len(with_grad) > len(dense)) == (layout == "ep2")
