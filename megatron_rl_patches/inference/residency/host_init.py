"""Build a model in host memory whatever its config says: megatron-core creates parameters with
`device=torch.cuda.current_device()` unless `use_cpu_initialization` is set, and a swap/stream
build must never hold the whole model on the device."""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
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


def move_all_but(chunks: Iterable[torch.nn.Module], device: torch.device, kept: set[int]) -> None:
    """Move what a host-built model needs on the device, except the parameters whose ids are in
    `kept` (their host copies are managed by residency): other parameters, buffers, and plain
    tensor attributes (e.g. a rotary embedding's `inv_freq`, which `Module.to` does not move)."""
    for chunk in chunks:
        for module in chunk.modules():
            for name, param in module.named_parameters(recurse=False):
                if id(param) not in kept and param.device != device:
                    moved = param.data.to(device)
                    if torch._has_compatible_shallow_copy_type(param, moved):  # as Module._apply decides
                        param.data = moved
                    else:
                        module._parameters[name] = torch.nn.Parameter(moved, requires_grad=param.requires_grad)
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.device != device:
                    module._buffers[name] = buffer.to(device)
            for name, value in list(vars(module).items()):
                plain = isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
                if plain and value.device != device:
                    object.__setattr__(module, name, value.to(device))
