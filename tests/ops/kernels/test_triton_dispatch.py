"""Choosing the Triton backend: ``auto`` keeps the torch tiles on CPU and picks the kernels on
CUDA (not ROCm); a forced ``triton`` that cannot run is a named error saying why (no triton, CPU
without the interpreter, ROCm); the environment variable forces it like ``backend=``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_rl_patches.ops import kernels
from megatron_rl_patches.ops.kernels.triton import LazyTritonTiles

pytestmark = pytest.mark.triton
ROOT = Path(__file__).resolve().parents[3]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", kernels.BACKEND_ENV)}
    first = [env.pop("PYTHONPATH")] if "PYTHONPATH" in env else []
    environ.update(env, PYTHONPATH=os.pathsep.join([*first, str(ROOT), environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True, text=True,
                          timeout=120)


FORCED_ON_CPU = """
    import torch
    from megatron_rl_patches import log_probs_and_entropy
    try:
        log_probs_and_entropy(torch.randn(4, 16), torch.tensor([1, 2, 3, 4]), backend="triton")
    except ValueError as exc:
        print(exc)
    else:
        print("ran")
"""


def test_auto_keeps_the_torch_tiles_on_cpu_and_names_both_backends():
    assert kernels.resolve_backend("auto", CPU).name == "torch"
    assert kernels.backend_names() == ("auto", "torch", "triton", "gemm")


def test_forced_triton_without_triton_says_it_cannot_be_imported():
    result = _run("import sys; sys.modules['triton'] = None\n" + textwrap.dedent(FORCED_ON_CPU))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("backend='triton' cannot run on cpu: triton cannot be imported")
    assert "choose backend='torch' or 'auto'" in result.stdout


def test_forced_triton_on_cpu_without_the_interpreter_says_how_to_get_it():
    pytest.importorskip("triton")
    result = _run(FORCED_ON_CPU)
    assert result.returncode == 0, result.stderr
    assert "backend='triton' cannot run on cpu" in result.stdout and "TRITON_INTERPRET=1" in result.stdout


# Other tritons the lanes can meet (the GPU machine's 3.6 beside the lanes' 3.7), each a folder that
# `pip install --no-deps --target DIR triton==X` filled, put first on the path (os.pathsep-separated)
OTHER_TRITONS = [p for p in os.environ.get("MRP_OTHER_TRITONS", "").split(os.pathsep) if p]

# the fused head too: its hidden-size loop is the other loop whose bound comes from an argument
FUSED_ON_CPU = """
    import torch
    from megatron_rl_patches import lm_head_log_probs_and_entropy
    h, w, t = torch.randn(5, 24), torch.randn(50, 24), torch.tensor([1, 2, 3, 4, 5])
    want = lm_head_log_probs_and_entropy(h, w, t, backend="torch")[0]
    print(float((lm_head_log_probs_and_entropy(h, w, t)[0] - want).abs().max()))
"""


@pytest.mark.parametrize("other_triton", [None, *OTHER_TRITONS])
def test_environment_variable_forces_the_kernels_under_the_interpreter(other_triton):
    """Before, triton 3.6's interpreter (every int argument a 1-element array, ``int()`` of it
    refused by numpy >= 2.4) failed the column loop's run-time bounds: TypeError."""
    pytest.importorskip("triton")
    path = {} if other_triton is None else {"PYTHONPATH": other_triton}
    result = _run(FORCED_ON_CPU.replace(', backend="triton"', ""), TRITON_INTERPRET="1",
                  MEGATRON_RL_PATCHES_BACKEND="triton", **path)
    assert result.returncode == 0 and result.stdout.strip() == "ran", result.stdout + result.stderr
    result = _run(FUSED_ON_CPU, TRITON_INTERPRET="1", MEGATRON_RL_PATCHES_BACKEND="triton", **path)
    assert result.returncode == 0 and float(result.stdout) < 1e-5, result.stdout + result.stderr
    result = _run(FORCED_ON_CPU.replace(', backend="triton"', ""), MEGATRON_RL_PATCHES_BACKEND="triton")
    assert "MEGATRON_RL_PATCHES_BACKEND='triton' cannot run on cpu" in result.stdout


def test_rocm_is_refused_by_name_and_left_to_the_torch_tiles(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    proxy = LazyTritonTiles()
    assert not proxy.claims(CUDA)
    assert proxy.available(CUDA) == "ROCm (torch.version.hip=6.2.41133) is not supported by these kernels"
    assert kernels.resolve_backend("auto", CUDA).name == "torch"
    with pytest.raises(ValueError, match=r"backend='triton' cannot run on cuda: ROCm"):
        kernels.resolve_backend("triton", CUDA)


def test_cuda_tensors_are_claimed_where_triton_imports():
    pytest.importorskip("triton")
    proxy = LazyTritonTiles()
    assert proxy.claims(CUDA) and not proxy.claims(CPU)
    assert proxy.available(CUDA) is None  # a CUDA build of torch is not needed to decide
    assert proxy.available(torch.device("meta")) == "Triton kernels run on CUDA tensors, not on meta"
