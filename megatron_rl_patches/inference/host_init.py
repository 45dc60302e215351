"""Build a model in host memory whatever its config says: megatron-core creates parameters with
`device=torch.cuda.current_device()` unless `use_cpu_initialization` is set, and a swap/stream
build must never hold the whole model on the device."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _on_device(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return True  # a bare index is a CUDA device for torch factories
    return isinstance(value, (str, torch.device)) and torch.device(value).type == "cuda"


class _HostFactories(TorchFunctionMode):
    """Tensor factories and `.cuda()` / `.to(cuda)` land on the CPU instead."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _on_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _on_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_initialization(active: bool) -> Iterator[None]:
    """Inside (when `active`): parameters a model provider creates stay in host memory."""
    if not active:
        yield
        return
    with _HostFactories():
        yield
