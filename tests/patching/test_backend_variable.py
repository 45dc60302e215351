"""MEGATRON_RL_PATCHES_BACKEND has one parser (issue 29 defect 3): every value the launcher and
`doctor` accept is one the ops run with, and the other way round — case, spaces and `auto` included."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import log_probs_and_entropy, settings
from megatron_rl_patches.integrations import default_registry
from megatron_rl_patches.ops import kernels
from megatron_rl_patches.patching import env
from megatron_rl_patches.patching.startup import launcher

VARIABLE = "MEGATRON_RL_PATCHES_BACKEND"
ACCEPTED = ["Torch", " TORCH ", "torch", "auto", " Auto", "", "  "]
REFUSED = ["cuda", "tοrch", "torch,triton", "AUTO!"]


def _launcher_accepts(value: str) -> bool:
    try:
        launcher.launch_environment("all", {VARIABLE: value, "PATH": "/usr/bin"})
    except ValueError as exc:
        assert f"{VARIABLE}=" in str(exc)
        return False
    return True


def _ops_accept(value: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setenv(VARIABLE, value)
    logits, tokens = torch.randn(3, 8, dtype=torch.float64), torch.tensor([1, 2, 7])
    try:
        log_probs, _ = log_probs_and_entropy(logits, tokens)
    except ValueError as exc:
        assert f"{VARIABLE}=" in str(exc) and "is not a backend" in str(exc)
        return False
    torch.testing.assert_close(log_probs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    return True


@pytest.mark.parametrize("value", ACCEPTED)
def test_a_value_the_launcher_accepts_runs_the_ops(value, monkeypatch):
    assert _launcher_accepts(value)
    assert _ops_accept(value, monkeypatch)
    assert env.summary({VARIABLE: value})["errors"] == []


@pytest.mark.parametrize("value", REFUSED)
def test_a_value_the_ops_refuse_the_launcher_and_doctor_refuse(value, monkeypatch):
    assert not _ops_accept(value, monkeypatch)
    assert not _launcher_accepts(value)
    (error,) = env.summary({VARIABLE: value})["errors"]
    assert f"{VARIABLE}={value!r} is not a backend" in error and "torch or triton or gemm" in error


def test_the_variable_reads_as_the_backend_the_ops_pick():
    """One reader (issue 113): the patch machinery's is the ops' (`settings.backend`, "auto" where each op
    chooses); `doctor`'s JSON still says null there, as before."""
    assert env.backend is settings.backend
    assert env.backend({VARIABLE: " Torch "}) == "torch"
    assert env.backend({VARIABLE: "AUTO"}) == "auto" == env.backend({}) == env.backend({VARIABLE: ""})
    assert env.summary({VARIABLE: "AUTO"})["backend"] is None and env.summary({})["backend"] is None
    assert env.summary({VARIABLE: " Torch "})["backend"] == "torch"
    assert kernels.resolve_backend(None, torch.device("cpu")).name == "torch"


def test_the_launcher_checks_names_the_ops_know(monkeypatch):
    monkeypatch.setenv(VARIABLE, "TORCH")
    assert kernels.resolve_backend("auto", torch.device("cpu")).name == "torch"
    env.check(default_registry().patch_names(), {VARIABLE: "TORCH"})
