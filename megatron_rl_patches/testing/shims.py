"""Test-only shims that let megatron-core run on CPU (it hard-codes CUDA in a few places).

Never used by library code: only by the pytest plugin, the CPU demo and the Megatron-LM session.
Each shim, and what needs it (checked by removing one at a time; `torch.cuda` functions that
already work on CPU, such as `stream()`, `Event`, `empty_cache` and the `memory_*` counters, are
left alone):
- `torch.cuda.current_device`, CUDA factory calls (`device="cuda"`) and the CUDA RNG tracker's
  `fork`: every megatron-core release (model build, DDP buffers).
- `torch.cuda.synchronize`: megatron-core's timers (Megatron-LM's train()).
- `torch.cuda.current_stream` / `Stream`: 0.19's `start_grad_sync` waits on the current stream;
  Megatron-LM's `get_model` (0.19) builds DDP under a side stream. CPU work is already ordered,
  so every wait or record is a no-op.
- `torch.nn.Module.cuda`: Megatron-LM's `get_model` (0.19) moves the model to the GPU (no-op here).
- `Tensor.cuda()` (through the factory mode): 0.13's pipelined schedules build a token counter
  with `torch.tensor(0).cuda()` (identity on CPU).
- `torch.Tensor.type()`: megatron-core's optimizers compare type names (`'torch.cuda.FloatTensor'`)
  to build the distributed optimizer and check grads; CPU tensors report the `torch.cuda.*` name
  (no argument only; conversions are untouched).
- `WrappedTorchNorm.__new__` (the local spec's norm without Apex): it asserts against sequence
  parallelism. Under SP the shim builds the same torch norm and marks its parameters
  `sequence_parallel`, as Transformer Engine's and Apex's norms do, so `finalize_model_grads`
  sums their gradients over the tensor-parallel group (each rank saw a slice of the sequence).
- `tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`: activation recompute
  (`recompute_granularity`) saves and restores the CUDA RNG state around each recomputed layer;
  on CPU there is none (the CPU generator's state, which megatron saves itself, stands in).
- `Tensor.cuda()` and (where NeMo-RL is loaded) `torch.tensor(..., pin_memory=True)` outside the
  factory mode too: a mode is off inside a torch function it handles, so a backward pass run
  through it sees none (NeMo-RL's context-parallel all-gather builds a pinned index `.cuda()` in
  its backward).
- `moe_utils.te_general_gemm` = None: megatron-core < 0.17 without Transformer Engine leaves the
  name undefined and its MoE router's gating linear raises `NameError` (None: the torch matmul).
"""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_MISSING = object()


def _names_cuda(device: Any) -> bool:
    return isinstance(device, (str, torch.device)) and "cuda" in str(device)


class CudaToCpuMode(TorchFunctionMode):
    """Redirect tensor factory calls that ask for a CUDA device (device="cuda", an int) to CPU,
    drop `pin_memory=True` (megatron-core's RoPE under context parallelism pins its chunk ids);
    `Tensor.cuda()` returns the tensor itself; `Tensor.to("cuda")` with the device positional
    (NeMo-RL's `data_dict.to("cuda")`) stays on CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _names_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or "cuda" in str(device)):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):  # no pinned-memory allocator without an accelerator
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


class CpuEvent:
    """What `CpuStream.record_event` returns: CPU work is ordered, so it is always complete."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuStream:
    """Stands in for `torch.cuda.Stream` (and the current stream): waits and records are no-ops."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        return event if event is not None else CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_CPU_STREAM = CpuStream()


def _null_fork(self: Any, name: str = "") -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


def _module_cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
    return self


_TENSOR_TYPE = torch.Tensor.type


def _tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    """`Tensor.type()` naming CPU tensors `torch.cuda.*`; with a `torch.cuda.*` string, converts on CPU."""
    if dtype is None and not kwargs:
        name = _TENSOR_TYPE(self)
        if self.device.type == "cpu" and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = "torch." + dtype[len("torch.cuda."):]
    return _TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


def _torch_norm_serving_sp(original_new: Any) -> Any:
    def new(cls: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        if not getattr(config, "sequence_parallel", False):
            return original_new(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)  # a shallow copy: no __post_init__ re-run
        plain.sequence_parallel = False
        norm = original_new(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return staticmethod(new)


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _unpinned_tensor(original: Any) -> Any:
    def tensor(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return original(*args, **kwargs)

    return tensor


def _shim_table() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for every shim, in one place."""
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return [
        (moe_utils, "te_general_gemm", None),
        (WrappedTorchNorm, "__new__", _torch_norm_serving_sp(WrappedTorchNorm.__new__)),
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda *args, **kwargs: None),
        (mcore_random.CudaRNGStatesTracker, "fork", _null_fork),
        (mcore_random, "_get_cuda_rng_state", _cpu_rng_state),
        (mcore_random, "_set_cuda_rng_state", _set_no_cuda_rng_state),
        (torch.cuda, "Stream", CpuStream),
        (torch.cuda, "current_stream", lambda device=None: _CPU_STREAM),
        (torch.nn.Module, "cuda", _module_cuda),
        (torch.Tensor, "type", _tensor_type),
        (torch.Tensor, "cuda", _tensor_cuda),
        # only where NeMo-RL is loaded (its context-parallel backward pins an index): a Python
        # torch.tensor in every process changed Hugging Face teachers' numbers (test_hf_fp8)
        *([(torch, "tensor", _unpinned_tensor(torch.tensor))] if "nemo_rl" in sys.modules else []),
    ]


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Apply the shims listed in the module docstring and redirect CUDA factory calls to CPU for the
    duration of the block; every attribute is restored (or removed, if it was inherited) on exit."""
    table = _shim_table()
    saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in table]
    try:
        for owner, name, replacement in table:
            setattr(owner, name, replacement)
        with CudaToCpuMode():
            yield
    finally:
        for owner, name, value in reversed(saved):
            if value is _MISSING:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)
