"""The ``triton`` backend (Triton kernels, their own ``tl.dot`` GEMM) and the ``gemm`` backend (the
vendor's GEMM into fp32 buffers, then the same kernels' row passes), each behind a proxy: importing
this package imports no triton; the kernels (:mod:`.backend`, :mod:`.gemm_backend`) load on first use.

``available(device)`` is None on CUDA (not ROCm) with triton importable, and on CPU when
``TRITON_INTERPRET=1`` was set before the kernels were first imported (Triton picks its
interpreter when a kernel is decorated); ``claims(device)``: CUDA, not ROCm, and the backend is
:data:`CUDA_DEFAULT`, so ``auto`` picks it there and keeps the torch tiles on CPU.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch

from megatron_rl_patches.ops.kernels.contract import Backend

# The backend ``auto`` picks for CUDA tensors: the one place to flip after a GPU run's figures
# (docs/benchmarks.md, "The fused head on a GPU"). "triton" until the ``gemm`` route is measured
# on a GPU: its case (the GEMM at the vendor's speed, the Triton work a streaming row pass) is
# made on CPU only so far.
CUDA_DEFAULT = "triton"


class LazyTritonTiles(Backend):
    """Stands for :class:`.backend.TritonTiles` until a call needs it: the registry answers
    `available` / `claims` here and hands the ops the loaded backend (:meth:`loaded`)."""

    name = "triton"
    module, class_name = "megatron_rl_patches.ops.kernels.triton.backend", "TritonTiles"

    def __init__(self) -> None:
        self._real: Any = None
        self._import_error: str | None = None

    def _load(self) -> Any:
        if self._real is None and self._import_error is None:
            try:
                module = importlib.import_module(self.module)
            except ImportError as exc:  # triton absent or broken: say so when the backend is asked for
                self._import_error = f"triton cannot be imported ({type(exc).__name__}: {exc})"
            else:
                self._real = getattr(module, self.class_name)()
        return self._real

    def available(self, device: torch.device) -> str | None:
        if device.type == "cuda" and torch.version.hip:
            return f"ROCm (torch.version.hip={torch.version.hip}) is not supported by these kernels"
        real = self._load()
        return self._import_error if real is None else real.available(device)

    def claims(self, device: torch.device) -> bool:
        return device.type == "cuda" and not torch.version.hip and self.name == CUDA_DEFAULT

    def claims_for(self, device: torch.device, dtype: torch.dtype | None) -> bool:
        """fp64 inputs are left to the torch tiles (tl.dot has no fp64 path on every GPU)."""
        return self.claims(device) and dtype != torch.float64

    def loaded(self) -> Backend:
        real = self._load()
        if real is None:  # available() said why before any call gets here
            raise ValueError(f"backend 'triton' cannot run: {self._import_error}")
        return real


class LazyVendorGemm(LazyTritonTiles):
    """Stands for :class:`.gemm_backend.VendorGemm` (the ``gemm`` backend) until a call needs it."""

    name = "gemm"
    module, class_name = "megatron_rl_patches.ops.kernels.triton.gemm_backend", "VendorGemm"
