"""`train_reentry`: the records for a framework module defining train() and the module-level
enable/disable_forward_pre_hook(model_chunks) helpers (Megatron-LM and slime both do), and the
wrappers they install. The work itself is in :mod:`megatron_rl_patches.reentrant`."""
# lazy imports: import cost: the start-up hook loads this module with MEGATRON_RL_PATCHES=all (test_lazy_import)
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_rl_patches.patching.records import Patch

# The wrappers import their helpers when first called: declaring the records (at start-up, in
# every process) must stay cheap.

HERE = "megatron_rl_patches.integrations.megatron.train_reentry"


def train_reentry_patches(module: str, train_params: tuple[str, ...], framework: str) -> tuple[Patch, ...]:
    """The three records for `module`. Frameworks ship no usable version metadata: the
    parameter lists are the guard."""

    def record(attribute: str, wrapper: str, description: str, params: tuple[str, ...]) -> Patch:
        return Patch(
            name="train_reentry",
            target=f"{module}:{attribute}",
            wrapper=f"{HERE}:{wrapper}",
            description=f"{framework} {description}",
            requires=None,
            params=params,
        )

    return (
        record("train", "train_wrapper", "train() callable once per rollout", train_params),
        record("enable_forward_pre_hook", "enable_hooks_helper_wrapper",
               "enable_forward_pre_hook(model_chunks) idempotent", ("model_chunks",)),
        record("disable_forward_pre_hook", "disable_hooks_helper_wrapper",
               "disable_forward_pre_hook(model_chunks, param_sync) idempotent", ("model_chunks",)),
    )


def train_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """A known train(): the sync-function guard around it (see reentrant_train)."""
    from megatron_rl_patches.reentrant import call_guarded

    return call_guarded(wrapped, args, kwargs)


def _helper_chunks(bound: Any) -> list[Any] | None:
    """The chunks a helper was given, or None when it should run unchanged (a call we do not
    understand, or a chunk that is neither DDP-like nor built inference-only)."""
    from megatron_rl_patches.inference.guard import is_inference_only
    from megatron_rl_patches.model.chunks import as_chunks, is_ddp_like

    if bound is None or bound.arguments.get("model_chunks") is None:
        return None
    chunks = as_chunks(bound.arguments["model_chunks"])
    if not all(is_ddp_like(c) or is_inference_only(c) for c in chunks):
        return None
    # an inference-only chunk has no DDP hooks to toggle
    return [c for c in chunks if is_ddp_like(c)]


def enable_hooks_helper_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """enable_forward_pre_hook(model_chunks): idempotent per chunk."""
    from megatron_rl_patches.model.arguments import bind
    from megatron_rl_patches.reentrant import enable_hooks

    chunks = _helper_chunks(bind(wrapped, args, kwargs))
    if chunks is None:
        return wrapped(*args, **kwargs)
    for chunk in chunks:
        enable_hooks(chunk)
    return None


def disable_hooks_helper_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """disable_forward_pre_hook(model_chunks, param_sync=True): idempotent per chunk."""
    from megatron_rl_patches.model.arguments import bind
    from megatron_rl_patches.reentrant import disable_hooks

    bound = bind(wrapped, args, kwargs)
    chunks = _helper_chunks(bound)
    if chunks is None:
        return wrapped(*args, **kwargs)
    param_sync = bool(bound.arguments.get("param_sync", True)) if bound is not None else True
    for chunk in chunks:
        disable_hooks(chunk, param_sync=param_sync)
    return None
