"""Every stand-in the slime lane uses, in one place: modules slime (624b824a) and its pinned
Megatron-LM import on the way to `slime.backends.megatron_utils.model` / `.loss` that need a GPU
or a server, registered in `sys.modules` before slime is imported. Nothing else is faked: slime's
train(), forward_only, get_batch, losses and Megatron's schedules, DDP and optimizer are real.

- `megatron.core.transformer.custom_layers.batch_invariant_kernels`: Triton kernels (GPU); its one
  name Megatron-LM's initialize/training import raises if called (batch-invariant mode is off).
- `wandb`: the experiment-tracking client (a server); slime only logs through it when enabled.
- `httpx`, `requests`: the HTTP clients slime's rollout side talks to SGLang servers with (a server).
- `sglang.srt.server_args`, `sglang_router.launch_router`: the inference server and its router
  (GPU + server); slime's argument module reads their argument classes.
"""
from __future__ import annotations

import sys
import types

STANDINS = (
    "megatron.core.transformer.custom_layers.batch_invariant_kernels",
    "wandb",
    "httpx",
    "requests",
    "sglang",
    "sglang.srt",
    "sglang.srt.server_args",
    "sglang_router",
    "sglang_router.launch_router",
)


def _needs_gpu(*args, **kwargs):
    raise RuntimeError("slime lane stand-in: this needs a GPU or a server, which the CPU lane does not have")


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__doc__ = "slime lane stand-in (tests/integrations/slime_lane/slime_standins.py)"
    module.__dict__.update(attributes)
    return module


def install() -> None:
    """Register the stand-ins (idempotent; a real module already imported is left alone)."""
    attributes = {
        STANDINS[0]: {"enable_batch_invariant_mode": _needs_gpu},
        "wandb": {"init": _needs_gpu, "log": _needs_gpu},
        "httpx": {"AsyncClient": type("AsyncClient", (), {"__init__": _needs_gpu})},
        "sglang.srt.server_args": {"ServerArgs": type("ServerArgs", (), {})},
        "sglang_router.launch_router": {"RouterArgs": type("RouterArgs", (), {})},
    }
    for name in STANDINS:
        if name not in sys.modules:
            sys.modules[name] = _module(name, **attributes.get(name, {}))


def cpu_accelerator() -> None:
    """slime's accelerator registry (`slime.utils.accelerator.set_accelerator`, its own plug-in
    point) given a CPU backend: slime's get_batch places cu_seqlens on `accelerator.device()`."""
    import torch
    from slime.utils import accelerator
    from slime.utils.accelerator.base import Accelerator

    class CpuAccelerator(Accelerator):
        name = "cpu"
        device_type = "cpu"

        def is_available(self) -> bool:
            return True

        def device(self, index=None) -> torch.device:
            return torch.device("cpu")

        def device_name(self, index=None) -> str:
            return "cpu"

        def set_device(self, index) -> None:
            return None

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def synchronize(self, device=None) -> None:
            return None

        def current_stream(self, device=None):
            return None

        def empty_cache(self) -> None:
            return None

        def mem_get_info(self, device=None) -> tuple[int, int]:
            return (0, 0)

        def memory_allocated(self, device=None) -> int:
            return 0

        def memory_reserved(self, device=None) -> int:
            return 0

    accelerator.set_accelerator(CpuAccelerator())
