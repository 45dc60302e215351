"""The Triton kernels compile for NVIDIA Hopper (sm_90, the H100/H200 the project's GPU runs use)
with this machine's triton, down to
a cubin, in a fresh process without the interpreter: the interpreter accepts programs the GPU
compiler rejects, so the interpreter tests alone would not show it. (The GPU machine's triton 3.6
is checked only where a GPU is lent; see docs/kernels.md.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton
HERE = Path(__file__).parent


def test_every_kernel_variant_compiles_to_a_cubin():
    pytest.importorskip("triton", reason="triton is not installed on this lane")
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # triton's own cache (TRITON_CACHE_DIR, else ~/.triton/cache), as mypy's is kept between runs: its key
    # is the kernel's source and what it calls, the constants, the options, triton's version and the
    # backend with its ptxas, so a variant is compiled for real the first time and whenever any of those
    # changes (59 s of one core in the newest lane), and read back otherwise; an empty TRITON_CACHE_DIR
    # compiles all again
    environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[2]), environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(HERE / "triton_compile_probe.py"), "90"], env=environ,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    # per arch: 2 dtypes x fused or not x flags on or off x 2 kernels, lm_head_divergence's
    # normalizer variant (row_stats_kernel, fused, k=0) in each dtype, and the top-k id kernel in
    # each dtype, fused or not, and lm_head_divergence's tile kernel (pass 2 and backward with every
    # flag in each dtype, every table row once), and the invariant kernel's two passes, bf16 fused
    # and fp32 logits, every flag on
    assert len(lines) == 2 * 2 * 2 * 2 + 2 + 2 * 2 + 2 * 2 + 7 + 2 * 2, proc.stdout
    assert all(line.endswith(": ok") for line in lines), proc.stdout
