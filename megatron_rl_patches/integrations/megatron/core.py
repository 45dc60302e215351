"""megatron-core's wrappers: DistributedDataParallel forward-pre-hook toggles made idempotent and
gradient accumulation windows over several schedule calls (records in `patches`)."""
from __future__ import annotations

import inspect
from typing import Any

from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.model.chunks import as_chunks, is_ddp_like
from megatron_rl_patches.reentrant import disable_with, enable_with, model_config
from megatron_rl_patches.windows import open_auto_windows, overlaps_grad_reduce


def _method_call(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> tuple[Any, inspect.BoundArguments] | None:
    """(chunk, arguments) of a call to a DDP method, bound or through the class (`self` in the
    arguments); None when the original should run unchanged: the call does not fit its
    signature, or the chunk is not DDP-like."""
    bound = bind(wrapped, args, kwargs)
    if bound is None:
        return None
    chunk = instance if instance is not None else bound.arguments.get("self")
    return (chunk, bound) if is_ddp_like(chunk) else None


def enable_forward_pre_hook_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`ddp_hooks`: DistributedDataParallel.enable_forward_pre_hook is a no-op when hooks are registered."""
    call = _method_call(wrapped, instance, args, kwargs)
    if call is None:
        return wrapped(*args, **kwargs)
    return enable_with(call[0], lambda: wrapped(*args, **kwargs))


def disable_forward_pre_hook_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`ddp_hooks`: DistributedDataParallel.disable_forward_pre_hook with no hooks registered
    only runs the requested param sync."""
    call = _method_call(wrapped, instance, args, kwargs)
    if call is None:
        return wrapped(*args, **kwargs)
    chunk, bound = call
    param_sync = bool(bound.arguments.get("param_sync", True))
    return disable_with(chunk, param_sync, lambda: wrapped(*args, **kwargs))


def schedule_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`grad_windows`: a training schedule call with `config.finalize_model_grads_func` unset is part
    of an accumulation window that ends at the next finish_grad_sync / finalize_model_grads
    (see megatron_rl_patches.windows); any other call runs unchanged."""
    bound = bind(wrapped, args, kwargs)
    if bound is None or bound.arguments.get("forward_only") or bound.arguments.get("model") is None:
        return wrapped(*args, **kwargs)

    chunks = [chunk for chunk in as_chunks(bound.arguments["model"]) if overlaps_grad_reduce(chunk)]
    if chunks:
        config = model_config(chunks[0])
        if config is not None and getattr(config, "finalize_model_grads_func", None) is None:
            open_auto_windows(chunks)
    return wrapped(*args, **kwargs)
