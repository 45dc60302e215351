"""The GPU commands on a machine without CUDA (issue 105 item 9), as a new user meets them: `make
bench-gpu` / `make test-gpu` with an interpreter that has no torch (the system's `python3`) or whose
torch sees no CUDA device, and `tools/gpu-check`: each one line naming what is missing, no
traceback; gpu-check's environment.txt holds a line per missing piece, not `nvidia-smi: command not
found` and a torch traceback."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# an interpreter without torch: Python's own, run isolated from this venv's site-packages
NO_TORCH = [sys.executable, "-I", "-S"]


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> str:
    """A `python` that has no torch (this interpreter with no site-packages), as one word for make."""
    wrapper = tmp_path_factory.mktemp("no-torch") / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {" ".join(NO_TORCH)} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def run(command: list[str], **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    return subprocess.run(command, cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120)


def cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("target", ["bench-gpu", "test-gpu"])
def test_a_gpu_target_without_torch_or_cuda_says_so_in_one_line(no_torch, target):
    if shutil.which("make") is None:
        pytest.skip("make is not installed here")
    if cuda_here():
        pytest.skip("this machine has a CUDA device")
    done = run(["make", "--no-print-directory", target, f"GPU_PYTHON={no_torch}"])
    assert done.returncode != 0 and "Traceback" not in done.stderr + done.stdout, done.stderr
    assert f"make: this target needs torch with a CUDA device, and {no_torch} has no torch" in done.stderr
    if target == "bench-gpu":  # the check both targets share, with a torch that sees no CUDA device
        done = run(["make", "--no-print-directory", target, f"GPU_PYTHON={sys.executable}"])
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert "make: this target needs a CUDA device (torch " in done.stderr and " sees none)" in done.stderr


def test_gpu_check_on_a_cpu_machine_writes_its_environment_and_stops_in_one_line(no_torch, tmp_path):
    if cuda_here():
        pytest.skip("this machine has a CUDA device")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for python, why in ((no_torch, f"{no_torch} has no torch"),):  # torch without CUDA: the make targets' check
        out = tmp_path / Path(python).name
        done = run(["tools/gpu-check", str(wheels), str(out)], GPU_PYTHON=python)
        assert done.returncode == 1, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith("tools/gpu-check: this machine cannot run the GPU check: ") and why in line and \
            line.endswith(" (environment.txt written)"), line
        written = (out / "environment.txt").read_text()
        assert "command not found" not in written and "Traceback" not in written, written
        if shutil.which("nvidia-smi") is None:
            assert "nvidia-smi: none on this machine (no NVIDIA driver)" in written
        if python == no_torch:
            assert "torch: not importable (ModuleNotFoundError)" in written
