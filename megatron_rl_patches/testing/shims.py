"""Test-only shims that let megatron-core run on CPU (it hard-codes CUDA in a few places).

Never used by library code: only by the pytest plugin and the CPU demo.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode


class CudaToCpuMode(TorchFunctionMode):
    """Redirect tensor factory calls that ask for a CUDA device (device="cuda", an int) to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or "cuda" in str(device)):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _null_fork(self: Any, name: str = "") -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Patch torch.cuda.current_device/synchronize, the CUDA RNG tracker's fork and CUDA factory
    calls for the duration of the block; everything is restored on exit."""
    from megatron.core.tensor_parallel import random as mcore_random

    saved = [
        (torch.cuda, "current_device", torch.cuda.current_device),
        (torch.cuda, "synchronize", torch.cuda.synchronize),
        (mcore_random.CudaRNGStatesTracker, "fork", mcore_random.CudaRNGStatesTracker.fork),
    ]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    mcore_random.CudaRNGStatesTracker.fork = _null_fork  # type: ignore[assignment]
    try:
        with CudaToCpuMode():
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
