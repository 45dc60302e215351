"""Make a Megatron-style train() callable once per rollout.

Three pieces, usable alone or through the registry patches `ddp_hooks` and `train_reentry`
(their wrappers live in ``integrations.megatron.core`` and ``integrations.megatron.train_reentry``):
idempotent forward-pre-hook toggles for DDP-like model chunks (`enable_hooks`, `disable_hooks`),
a guard that clears the chunks' own sync functions from the shared config before train() installs
them again (and puts config and hook state back if train() raises), and `reentrant_train`.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from megatron_rl_patches._log import logger, warn_once
from megatron_rl_patches.inference.guard import assert_trainable
from megatron_rl_patches.model.chunks import DDP_HOOK_ATTRS, as_chunks, is_ddp_like, iter_wrapped

F = TypeVar("F", bound=Callable[..., Any])

# config slot -> the DDP method train() installs there (Megatron-LM / slime train())
SYNC_SLOTS: tuple[tuple[str, str], ...] = (
    ("no_sync_func", "no_sync"),
    ("grad_sync_func", "start_grad_sync"),
    ("param_sync_func", "start_param_sync"),
)
_MODEL_ARG_NAMES = ("model", "model_chunks")
_MARK = "__mrp_reentrant__"

_ALL, _NONE, _PARTIAL = "all", "none", "partial"

# ids of the model chunks whose train() is already guarded in this context (nested wrappers).
# Not an argument: the wrapped train(rollout_id, model, optimizer, ...) is Megatron-LM's / slime's own signature.
_guarded: contextvars.ContextVar[frozenset[tuple[int, ...]]] = contextvars.ContextVar(
    "megatron_rl_patches_guarded", default=frozenset()
)


def _require_ddp_like(chunk: Any, caller: str) -> None:
    if not is_ddp_like(chunk):
        raise TypeError(
            f"{caller}(chunk): expected a DistributedDataParallel model chunk (an object with "
            f"{', '.join(DDP_HOOK_ATTRS)}), got {type(chunk).__name__}; pass the DDP wrapper, not the "
            "module inside it"
        )


def _hook_state(chunk: Any) -> str:
    """'all' when every submodule has its pre-hook handle (upstream's enabled state), 'none'
    when no handle is registered, 'partial' otherwise (a toggle interrupted half-way)."""
    handles = chunk.remove_forward_pre_hook_handles
    if not handles:
        return _NONE
    modules = list(chunk.module.modules())
    if len(handles) == len(modules) and all(module in handles for module in modules):
        return _ALL
    return _PARTIAL


def _drop_handles(chunk: Any) -> None:
    """Remove whatever pre-hooks a partial state left, so the chunk is consistently disabled."""
    handles = chunk.remove_forward_pre_hook_handles
    count = len(handles)
    for module in list(handles):
        handle = handles.pop(module)
        if handle is not None:
            handle.remove()
    warn_once(
        f"a DistributedDataParallel chunk had forward pre-hooks on only some of its modules "
        f"({count} handle(s)); they were removed to restore a consistent state"
    )


def enable_with(chunk: Any, call_original: Callable[[], Any]) -> Any:
    if not chunk.use_forward_hook:
        return call_original()  # upstream's own assert explains the misuse
    state = _hook_state(chunk)
    if state == _ALL:
        return None
    if state == _PARTIAL:
        _drop_handles(chunk)
    return call_original()


def disable_with(chunk: Any, param_sync: bool, call_original: Callable[[], Any]) -> Any:
    if not chunk.use_forward_hook:
        return call_original()
    state = _hook_state(chunk)
    if state == _ALL:
        return call_original()
    if state == _PARTIAL:
        _drop_handles(chunk)
    # what upstream does after its hook loop: the forced (synchronous) param all-gather
    if param_sync:
        chunk.start_param_sync(force_sync=True)
    return None


def enable_hooks(chunk: Any) -> None:
    """Register the chunk's forward pre-hooks unless they already are (no second-call assert)."""
    _require_ddp_like(chunk, "enable_hooks")
    enable_with(chunk, chunk.enable_forward_pre_hook)


def disable_hooks(chunk: Any, param_sync: bool = True) -> None:
    """Remove the chunk's forward pre-hooks if registered (no KeyError when already removed);
    with `param_sync` the forced parameter all-gather runs in either case, as upstream's does."""
    _require_ddp_like(chunk, "disable_hooks")
    disable_with(chunk, bool(param_sync), lambda: chunk.disable_forward_pre_hook(param_sync=param_sync))


# --- the sync-function guard ---------------------------------------------------------------

def _is_chunk_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(is_ddp_like(v) for v in value)


def _walk_config(model: Any) -> Any:
    # megatron.core.utils.get_model_config semantics: the first non-None `config` down `.module`
    for module in iter_wrapped(model):
        config = getattr(module, "config", None)
        if config is not None:
            return config
    raise RuntimeError("no `config` attribute on the model or the modules it wraps")


def model_config(chunk: Any) -> Any:
    """The config shared by the model chunks (megatron.core.utils.get_model_config), or None."""
    # Real DDP chunks mean megatron.core.utils is already imported; importing it only for a
    # duck-typed chunk would cost seconds, so the same walk is done here instead.
    utils = sys.modules.get("megatron.core.utils")
    get_config = getattr(utils, "get_model_config", None) or _walk_config
    try:
        return get_config(chunk)
    except (RuntimeError, AttributeError) as exc:
        logger.debug("megatron-rl-patches: no model config on %s: %s", type(chunk).__name__, exc)
        return None


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)  # bound methods: equal when __self__ (by identity) and __func__ match
    except Exception:  # an object whose == does not give a truth value is not ours
        return False


def _is_own(value: Any, chunks: Sequence[Any], method: str) -> bool:
    """True when `value` is what train() installs: the chunks' own bound `method`, alone for a
    single chunk or as a list (one per chunk, in order)."""
    own = [getattr(chunk, method, None) for chunk in chunks]
    if not own or any(m is None for m in own):
        return False
    if isinstance(value, (list, tuple)):
        return len(value) == len(own) and all(_same(v, m) for v, m in zip(value, own))
    return len(own) == 1 and _same(value, own[0])


def _foreign_message(slot: str, method: str, value: Any) -> str:
    what = f"config.{slot} holds {value!r}, which is not the model chunks' own `{method}`"
    if slot == "no_sync_func":
        return (
            f"{what} (a custom function, or one bound to other model chunks). It is left in place, "
            "so train()'s `assert config.no_sync_func is None` (with overlap_grad_reduce) will "
            "reject it: set config.no_sync_func = None before train(), or disable "
            "overlap_grad_reduce to keep a custom no_sync_func"
        )
    return (
        f"{what}. It is left in place; train() overwrites it when it installs its own "
        f"(align_grad_reduce / align_param_gather), else it is used as is"
    )


@dataclass
class _Entry:
    """State at train() entry, put back if train() raises."""

    config: Any
    sync_funcs: dict[str, Any] = field(default_factory=dict)
    hooks_enabled: list[tuple[Any, bool]] = field(default_factory=list)


def _enter(chunks: Sequence[Any]) -> _Entry:
    """Record the entry state, then put the chunks in the state a first call sees: forward
    pre-hooks registered (as DDP construction leaves them) and none of the chunks' own sync
    functions on the config."""
    entry = _Entry(config=model_config(chunks[0]) if chunks else None)
    entry.hooks_enabled = [
        (chunk, bool(chunk.remove_forward_pre_hook_handles))
        for chunk in chunks
        if is_ddp_like(chunk) and chunk.use_forward_hook
    ]
    # train() disables the hooks at entry and exit: re-registering them here lets its entry
    # disable succeed even on an unpatched DistributedDataParallel (no collective involved)
    for chunk, _ in entry.hooks_enabled:
        if _hook_state(chunk) != _ALL:
            enable_hooks(chunk)
    config = entry.config
    if config is None:
        return entry
    for slot, method in SYNC_SLOTS:
        if not hasattr(config, slot):
            continue
        value = getattr(config, slot)
        entry.sync_funcs[slot] = value
        if value is None:
            continue
        if _is_own(value, chunks, method):
            setattr(config, slot, None)
        else:
            warn_once(_foreign_message(slot, method, value))
    return entry


def _restore(entry: _Entry) -> None:
    """Put config sync slots and hook state back as they were at entry (no collectives)."""
    for slot, value in entry.sync_funcs.items():
        setattr(entry.config, slot, value)
    for chunk, enabled in entry.hooks_enabled:
        state = _hook_state(chunk)
        if enabled and state != _ALL:
            enable_hooks(chunk)
        elif not enabled and state != _NONE:
            # no param all-gather here: other ranks may not be in this error path
            disable_hooks(chunk, param_sync=False)


def stop_interval_timer() -> None:
    """Megatron-LM's train() starts its global 'interval-time' timer and leaves it running when it
    returns, so a second call asserts 'timer has already been started'. Stop it (no collective):
    the time between rollouts is not training time. A no-op without Megatron-LM's global timers."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    timers = getattr(global_vars, "_GLOBAL_TIMERS", None)
    timer = getattr(timers, "_timers", {}).get("interval-time")
    if timer is not None and getattr(timer, "_started", False):
        timer.stop()


def find_model_chunks(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[Any] | None:
    """The model chunks of a call to `fn`: the argument named `model` or `model_chunks`, else the
    first argument that is a DDP module or a sequence of them. None when the call does not fit
    `fn`'s signature; TypeError when no chunks can be found."""
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return None
        for name in _MODEL_ARG_NAMES:
            if name in bound.arguments:
                value = bound.arguments[name]
                return [] if value is None else as_chunks(value)
        values = list(bound.arguments.values())
    else:
        values = [*args, *kwargs.values()]
    for value in values:
        if is_ddp_like(value):
            return [value]
        if _is_chunk_sequence(value):
            return list(value)
    name = getattr(fn, "__qualname__", repr(fn))
    raise TypeError(
        f"reentrant_train: cannot find the model chunks in the call to {name}: expected an "
        f"argument named 'model' or 'model_chunks', or a DistributedDataParallel module (or a "
        f"list of them); got arguments of types "
        f"({', '.join(type(v).__name__ for v in values)}). Rename the parameter to `model`"
    )


def call_guarded(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    chunks = find_model_chunks(fn, args, kwargs)
    if not chunks:  # a call that does not bind (fn raises its own TypeError) or no chunks
        return fn(*args, **kwargs)
    assert_trainable(chunks)
    key = tuple(id(chunk) for chunk in chunks)
    active = _guarded.get()
    if key in active:  # an outer wrapper already guards this train()
        return fn(*args, **kwargs)
    entry = _enter(chunks)
    stop_interval_timer()
    token = _guarded.set(active | {key})
    try:
        return fn(*args, **kwargs)
    except BaseException:
        try:
            _restore(entry)
        except Exception:  # never hide train()'s own error behind a restore error
            logger.exception("megatron-rl-patches: could not restore state after train() raised")
        raise
    finally:
        _guarded.reset(token)


def reentrant_train(fn: F) -> F:
    """Wrap a Megatron-style train() so it can run once per rollout: the chunks' own sync
    functions are cleared from the shared config on entry, state is restored if it raises.
    Signature and return value are preserved; applying it twice wraps once."""
    if not callable(fn):
        raise TypeError(f"reentrant_train(fn): expected a callable train function, got {type(fn).__name__}")
    if getattr(fn, _MARK, False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return call_guarded(fn, args, kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper  # type: ignore[return-value]
