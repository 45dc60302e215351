"""A test vLLM server's processes ask Linux for the AMX tile state (`vllm_server.STARTUP`, its
sitecustomize): vLLM's CPU attention runs AMX instructions for bf16 without asking, and died of
SIGILL on an Intel Xeon with AMX. The permission ends at exec, so the request must run in each
fresh interpreter, as it does through PYTHONPATH."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl_patches.testing import vllm_server

ARCH_GET_XCOMP_PERM = 0x1022
HAS_AMX = Path("/proc/cpuinfo").exists() and " amx_tile" in Path("/proc/cpuinfo").read_text()
X86_LINUX = sys.platform == "linux" and platform.machine() == "x86_64"
# a fresh interpreter's granted xstate features (bit 18: AMX tile data), read with arch_prctl
PERMITTED = (
    "import ctypes; v = ctypes.c_uint64(); libc = ctypes.CDLL(None); "
    f"assert libc.syscall(158, {ARCH_GET_XCOMP_PERM}, ctypes.byref(v)) == 0; print(v.value >> 18 & 1)"
)


def fresh_interpreter(pythonpath: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    return subprocess.run([sys.executable, "-c", PERMITTED], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_server_process_starts_with_the_startup_folder_first_and_nothing_of_the_callers():
    assert vllm_server.server_path(False) == [str(vllm_server.STARTUP)]
    root = str(Path(vllm_server.__file__).resolve().parents[2])
    assert vllm_server.server_path(True) == [str(vllm_server.STARTUP), root]
    assert (vllm_server.STARTUP / "sitecustomize.py").is_file()


@pytest.mark.skipif(not X86_LINUX, reason="arch_prctl's AMX permission is x86-64 Linux's")
def test_each_fresh_interpreter_asks_for_amx_where_the_cpu_has_it():
    assert fresh_interpreter([]) == "0"  # not asked: not granted (exec starts without it)
    assert fresh_interpreter([str(vllm_server.STARTUP)]) == ("1" if HAS_AMX else "0")
