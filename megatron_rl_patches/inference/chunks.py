"""Model-chunk helpers of the frozen builds, used by `reentrant`, `windows` and the integrations too:
one chunk or a list of them, the `.module` chain of wrappers (Float16Module, DDP), and what counts
as a DDP chunk.

Imports nothing heavy: megatron-core and torch classes are looked up in `sys.modules` only, since
no object can be an instance of a class whose module was never imported.
"""
# lazy imports: import cost: inference.sizing.memory imports this module without torch (tests/test_lazy_import.py)
from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

# megatron-core DistributedDataParallel's forward-pre-hook / param-sync API (0.13 to 0.16+)
DDP_HOOK_ATTRS = ("remove_forward_pre_hook_handles", "use_forward_hook", "start_param_sync")

# (defining module, class name) of the wrappers whose state-dict keys carry a 'module.' prefix
_WRAPPERS = (
    ("megatron.core.transformer.module", "Float16Module"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel"),
)


def as_chunks(model_or_list: Any) -> list[Any]:
    """The model chunks as a new list: a list or tuple is copied, anything else is one chunk
    (None included: callers that give None a meaning check it first)."""
    if isinstance(model_or_list, (list, tuple)):
        return list(model_or_list)
    return [model_or_list]


def module_chunks(model_or_list: Any, argument: str) -> list[Any]:
    """as_chunks, requiring a non-empty list of torch.nn.Module; TypeError naming `argument`."""
    import torch

    chunks = as_chunks(model_or_list)
    if not chunks or not all(isinstance(chunk, torch.nn.Module) for chunk in chunks):
        found = type(model_or_list).__name__
        if chunks and isinstance(model_or_list, (list, tuple)):
            found += f" of {[type(chunk).__name__ for chunk in chunks]}"
        raise TypeError(
            f"{argument} must be a torch.nn.Module or a non-empty list of model chunks, got {found}"
        )
    return chunks


def iter_wrapped(module: Any) -> Iterator[Any]:
    """`module`, then the modules it wraps through `.module` (Float16Module, DDP, ...), outermost
    first; stops at a missing or None `.module` and at an object already seen (a cycle)."""
    seen: set[int] = set()
    while module is not None and id(module) not in seen:
        seen.add(id(module))
        yield module
        module = getattr(module, "module", None)


def is_ddp_like(obj: Any) -> bool:
    """True for megatron-core DistributedDataParallel or anything with its hook/sync API
    (DDP_HOOK_ATTRS): what the hook toggles and the train() guard need."""
    return all(hasattr(obj, name) for name in DDP_HOOK_ATTRS)


def has_grad_buffers(obj: Any) -> bool:
    """True for a megatron-core DistributedDataParallel whose grad buffers can be counted
    (`ddp_config` and `buffers`); stricter in purpose than is_ddp_like, which only needs hooks."""
    return hasattr(obj, "ddp_config") and hasattr(obj, "buffers")


def _wrapper_types() -> tuple[type, ...]:
    found = (getattr(sys.modules.get(module), name, None) for module, name in _WRAPPERS)
    return tuple(cls for cls in found if isinstance(cls, type))


def unwrap(module: Any) -> Any:
    """The model inside Float16Module / megatron-core DDP / torch DDP wrappers (whose state-dict
    keys carry 'module.'); any other object is returned as is."""
    wrappers = _wrapper_types()
    inner = module
    for inner in iter_wrapped(module):
        if not isinstance(inner, wrappers):
            break
    return inner
