"""Run by every process of a test's vLLM server (`vllm_server.launch` puts this folder first on the
server's PYTHONPATH; Python imports `sitecustomize` at start): asks Linux for the AMX tile state.

Linux hands a process the AMX tile registers only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM),
and the permission ends at exec, so each process asks for itself. vLLM 0.32's CPU attention picks
its AMX kernel for bfloat16 wherever the CPU has AMX and never asks: its engine core died of
SIGILL at a bf16 server's first request on an Intel Xeon with AMX (the API server then answers
HTTP 500, EngineDeadError). Where the CPU has no AMX, or this is not x86-64 Linux, the request
fails or is not made, and nothing changes."""
from __future__ import annotations

import ctypes
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86-64 Linux
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_amx() -> bool:
    """Ask for the AMX tile state; True where it was granted."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):  # no libc symbol to call: nothing asked
        return False


request_amx()
