"""`megatron-rl-patches demo` at reduced size: the summary's claims hold."""
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def test_demo_with_patches_completes_every_rollout_and_reports_true_savings():
    from megatron_rl_patches.demo.loop import DemoConfig
    from megatron_rl_patches.demo.session import run_demo
    from megatron_rl_patches.integrations import default_registry

    registry = default_registry()

    summary = run_demo(DemoConfig(rollouts=3, steps=1))
    json.dumps(summary)  # JSON-ready
    assert summary["ok"] and summary["error"] is None
    assert summary["rollouts_completed"] == 3
    assert [r["rollout"] for r in summary["rollouts"]] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["opd_kl"]) for r in summary["rollouts"])
    teachers = summary["teachers"]
    counted = teachers["trainable_build_bytes_per_teacher"]
    assert counted["grad_buffer"] > 0 and counted["optimizer_state"] > 0
    assert teachers["allocated_bytes"] == 0
    assert teachers["saved_bytes"] == teachers["count"] * (counted["grad_buffer"] + counted["optimizer_state"])
    # fp32 weights, DP=1, no distributed optimizer: 4 B grad + 8 B Adam per parameter, no padding
    assert teachers["formula_bytes_per_teacher"] == counted["total"] == 12 * teachers["params_per_teacher"]
    logprob = summary["logprob_saved_bytes"]
    assert logprob["ours_entropy_metric"] < logprob["naive"]
    assert logprob["ours_entropy_grad"] < logprob["naive"]
    assert all(status.status != "applied" for status in registry.applied())  # the demo reverts


def test_demo_without_patches_fails_on_rollout_two_with_a_readable_message():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl_patches", "demo", "--rollouts", "2", "--steps", "1", "--json", "--no-patches"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "MEGATRON_RL_PATCHES": ""},
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert summary["rollouts_completed"] == 1 and not summary["ok"]
    assert summary["error"]["rollout"] == 2
    assert summary["error"]["type"] == "AssertionError"
    assert "no_sync_func must be None" in summary["error"]["message"]
    assert "Traceback" not in proc.stderr


def test_demo_rejects_bad_arguments():
    from megatron_rl_patches.cli import main

    assert main(["demo", "--rollouts", "0"]) == 2
