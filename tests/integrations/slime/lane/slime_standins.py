"""Every stand-in the slime lane uses, in one place: modules slime (624b824a) and its pinned
Megatron-LM import on the way to `slime.backends.megatron_utils.model` / `.loss` that need a GPU
or a server, registered in `sys.modules` before slime is imported. Nothing else is faked: slime's
train(), forward_only, get_batch, losses and Megatron's schedules, DDP and optimizer are real.

- `megatron.core.transformer.custom_layers.batch_invariant_kernels`: Triton kernels (GPU); its one
  name Megatron-LM's initialize/training import raises if called (batch-invariant mode is off).
- `wandb`: the experiment-tracking client (a server); slime only logs through it when enabled.
- `httpx`, `requests`: the HTTP clients slime's rollout side talks to SGLang servers with (a server);
  a real httpx (the served teacher's client) is kept.
- `sglang.srt.server_args`, `sglang_router.launch_router`: the inference server and its router
  (GPU + server); slime's argument module reads their argument classes; `sglang.srt.patch_torch`,
  `.utils`, `.weight_sync.tensor_bucket`: the weight-sync pieces slime's actor module imports
  (never called: the lane pushes no weights to a server).
- `ray`: the cluster runtime slime's actors live in (a server); the actor module imports it and
  decorates with `ray.remote`, the lane calls the actor's methods in-process.
- `torch_memory_saver`: CUDA virtual-memory offload (GPU); only used when offloading.
- `transformers`: HF configs/tokenizers fetched from a hub (a server); the lane builds no HF model.
- host pinned memory (`cpu_pinned_memory`): slime's weight snapshots ask `pin_memory=True`, which
  needs an accelerator's allocator; on the CPU lane the flag is dropped (the same host memory).
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
    "sglang.srt.patch_torch",
    "sglang.srt.utils",
    "sglang.srt.weight_sync",
    "sglang.srt.weight_sync.tensor_bucket",
    "sglang_router",
    "sglang_router.launch_router",
    "ray",
    "ray.actor",
    "torch_memory_saver",
    "transformers",
)


def _needs_gpu(*args, **kwargs):
    raise RuntimeError("slime lane stand-in: this needs a GPU or a server, which the CPU lane does not have")


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__doc__ = "slime lane stand-in (tests/integrations/slime/lane/slime_standins.py)"
    module.__dict__.update(attributes)
    return module


def install() -> None:
    """Register the stand-ins (idempotent; a real module already imported is left alone)."""
    attributes = {
        STANDINS[0]: {"enable_batch_invariant_mode": _needs_gpu},
        "wandb": {"init": _needs_gpu, "log": _needs_gpu},
        "httpx": {"AsyncClient": type("AsyncClient", (), {"__init__": _needs_gpu})},
        "sglang.srt.patch_torch": {"monkey_patch_torch_reductions": _needs_gpu},
        "sglang.srt.utils": {"MultiprocessingSerializer": type("MultiprocessingSerializer", (), {})},
        "sglang.srt.weight_sync.tensor_bucket": {"FlattenedTensorBucket": type("FlattenedTensorBucket", (), {})},
        "sglang.srt.server_args": {"ServerArgs": type("ServerArgs", (), {})},
        "sglang_router.launch_router": {"RouterArgs": type("RouterArgs", (), {})},
        "ray": {"remote": lambda *a, **k: a[0] if a and callable(a[0]) else (lambda cls: cls),
                "get": _needs_gpu, "get_gpu_ids": _needs_gpu, "ObjectRef": type("ObjectRef", (), {})},
        "ray.actor": {"ActorHandle": type("ActorHandle", (), {})},
        "torch_memory_saver": {"torch_memory_saver": types.SimpleNamespace(hook_mode=None)},
        "transformers": {"AutoConfig": _needs_gpu, "AutoTokenizer": _needs_gpu},
    }
    try:  # the served teacher's client (the extra `served`) is a real library: kept where installed
        import httpx  # noqa: F401
    except ImportError:
        pass
    for name in STANDINS:
        if name not in sys.modules:
            sys.modules[name] = _module(name, **attributes.get(name, {}))


def cpu_pinned_memory(monkeypatch) -> None:
    """`torch.empty_like(..., pin_memory=True)` on a machine without an accelerator: the flag is
    dropped (slime's TensorBackuper snapshots into pinned host memory)."""
    import torch

    if torch.cuda.is_available():
        return
    empty_like = torch.empty_like

    def unpinned(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return empty_like(*args, **kwargs)

    monkeypatch.setattr(torch, "empty_like", unpinned)


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
