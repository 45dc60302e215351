"""Accumulation windows: one optimizer step's gradients spread over several schedule calls.

With `overlap_grad_reduce`, megatron-core's DistributedDataParallel starts a bucket group's
reduce from the backward hooks of the "last microbatch" of a schedule call. A loop that makes
several schedule calls per optimizer step (split train-step APIs, hand-written accumulation)
gets one "last microbatch" per call:

- 0.16.0 and later count `register_grad_ready` per parameter (`per_param_grad_ready_counts`), learn
  the counts of the first step (`golden_per_param_grad_ready_counts`, recorded by `reset()`) and
  start the reduce when a later step's counts equal them: a step with more calls than the first
  reduces before its last backward (silently wrong gradients), one with fewer never reduces
  (`finish_grad_sync`: "Communication call has not been issued for this bucket").
- 0.13.0 - 0.15.3 keep a `params_with_grad` set and assert "Cannot set grad twice": any step with two or
  more calls fails in its second call.

Inside a window the bucket groups' `register_grad_ready` and `start_grad_sync` are shadowed by
instance attributes that do nothing (the DDP backward hook, the schedules' `grad_sync_func` and
the bucket groups themselves call them through the instance), and the chunk's `finish_grad_sync`
by one that starts every bucket group's reduce with the finish's own arguments (`force_all_reduce`
where megatron-core has it), then lets upstream's own finish wait for it. Counts gathered in a
window are dropped, so `reset()` never learns golden counts from one and a later ordinary step
keeps upstream's exact overlap. No collective and no host sync is added: the window's one reduce
per bucket group replaces the one upstream would have started.

`accumulation_window(model)` opens a window for a `with` block; the `grad_windows` patch opens one
at every schedule call made with `config.finalize_model_grads_func` unset. Either ends at the
chunk's next `finish_grad_sync` (which `finalize_model_grads` calls per chunk): the reduce starts
there, when its arguments are known, never at a block's exit.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.model.chunks import as_chunks

# Bucket-group methods shadowed during a window (the names exist in megatron-core 0.13 - 0.20).
_GROUP_METHODS = ("register_grad_ready", "start_grad_sync")
_FINISH = "finish_grad_sync"


class AccumulationWindowError(RuntimeError):
    """A window cannot open or close consistently (a reduce already in flight, a non-DDP chunk)."""


@dataclass(eq=False)
class _Window:
    """One DDP chunk's window state."""

    chunk: Any
    groups: list[Any]
    explicit_depth: int = 0  # nested accumulation_window blocks on this chunk
    # ends at the chunk's next finish_grad_sync: opened by a schedule call (grad_windows), or an
    # accumulation_window block left with gradients pending
    until_finish: bool = False
    pending: bool = False  # a gradient became ready since the window's last reduce
    finished_inside: bool = False  # a finish_grad_sync ran inside an accumulation_window block
    shadows: list[tuple[Any, str]] = field(default_factory=list)


_windows: weakref.WeakKeyDictionary[Any, _Window] = weakref.WeakKeyDictionary()


def bucket_groups(chunk: Any) -> list[Any]:
    """Every bucket group of a megatron-core DDP chunk (dense and expert-parallel)."""
    return [*getattr(chunk, "bucket_groups", []), *getattr(chunk, "expert_parallel_bucket_groups", [])]


def overlaps_grad_reduce(chunk: Any) -> bool:
    """True for a megatron-core DDP chunk with `overlap_grad_reduce` (the only case windows change)."""
    config = getattr(chunk, "ddp_config", None)
    return bool(getattr(config, "overlap_grad_reduce", False)) and hasattr(chunk, "bucket_groups")


def _check_nothing_in_flight(window: _Window) -> None:
    for group in window.groups:
        if getattr(group, "grad_reduce_handle", None) is not None:
            raise AccumulationWindowError(
                "an accumulation window cannot start while a gradient reduce is in flight on this "
                "DistributedDataParallel chunk (gradients added now would miss it): call "
                "finalize_model_grads / finish_grad_sync to end the previous window first"
            )


def _clear_counts(group: Any) -> None:
    """Drop the readiness bookkeeping of the current step (0.16+: counts; 0.13 - 0.15: a set)."""
    if isinstance(getattr(group, "per_param_grad_ready_counts", None), dict):
        group.per_param_grad_ready_counts = {}
    if isinstance(getattr(group, "params_with_grad", None), set):
        group.params_with_grad = set()


@functools.cache
def _parameter_names(function: Any) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def _start_arguments(window: _Window, args: tuple, kwargs: dict) -> dict | None:
    """The arguments of a chunk's finish_grad_sync call that its bucket groups' start_grad_sync
    also takes (`force_all_reduce` from 0.16; none in 0.13); None when the call does not fit."""
    bound = bind(type(window.chunk).finish_grad_sync, (window.chunk, *args), kwargs)
    if bound is None:
        return None
    accepted = _parameter_names(type(window.groups[0]).start_grad_sync) if window.groups else frozenset()
    return {name: value for name, value in bound.arguments.items() if name != "self" and name in accepted}


def _start_reduce(window: _Window, arguments: dict) -> None:
    """Start every bucket group's reduce (upstream's own start_grad_sync, unshadowed)."""
    for group in window.groups:
        _clear_counts(group)
        # 0.19+: a group's finish_grad_sync returns at once while grad_reduce_finished is set
        # (only reset() clears it): this reduce must still be waited for
        if getattr(group, "grad_reduce_finished", False):
            group.grad_reduce_finished = False
    for group in window.groups:
        if group.grad_reduce_handle is None:
            type(group).start_grad_sync(group, **arguments)
    window.pending = False


def _install(window: _Window) -> None:
    def deferred_ready(*args: Any, **kwargs: Any) -> None:
        window.pending = True

    def deferred_start(*args: Any, **kwargs: Any) -> None:
        return None

    def finish(*args: Any, **kwargs: Any) -> Any:
        return _finish(window, args, kwargs)

    for group in window.groups:
        for name, shadow in zip(_GROUP_METHODS, (deferred_ready, deferred_start)):
            setattr(group, name, shadow)
            window.shadows.append((group, name))
    # nn.Module.__setattr__ keeps a plain function in the instance __dict__
    object.__setattr__(window.chunk, _FINISH, finish)
    window.shadows.append((window.chunk, _FINISH))


def _uninstall(window: _Window) -> None:
    for owner, name in window.shadows:
        owner.__dict__.pop(name, None)
    window.shadows.clear()
    _windows.pop(window.chunk, None)


def _finish(window: _Window, args: tuple, kwargs: dict) -> Any:
    """The chunk's finish_grad_sync during a window: the window's reduce is started here with the
    finish's arguments (as the synchronous reference does), then upstream's finish waits for it."""
    upstream = type(window.chunk).finish_grad_sync
    arguments = _start_arguments(window, args, kwargs)
    if arguments is None:  # upstream raises its own TypeError; nothing started, the window unchanged
        return upstream(window.chunk, *args, **kwargs)
    window.until_finish = False
    if window.explicit_depth == 0:
        _uninstall(window)
    else:
        window.finished_inside = True
    _start_reduce(window, arguments)
    # upstream's finish sees a handle on every group: on a first step (0.16+) its own
    # start_grad_sync returns early, then it waits; 0.19 marks the group finished
    return upstream(window.chunk, *args, **kwargs)


def _open(chunk: Any) -> _Window | None:
    if not overlaps_grad_reduce(chunk):
        return None
    window = _windows.get(chunk)
    if window is None:
        window = _Window(chunk=chunk, groups=bucket_groups(chunk))
        _check_nothing_in_flight(window)
        _install(window)
        _windows[chunk] = window
    return window


def open_auto_windows(chunks: list[Any]) -> None:
    """`grad_windows`: a schedule call with finalize_model_grads_func unset joins (or opens) a
    window on each chunk that overlaps its grad reduce; it ends at the chunk's finish_grad_sync."""
    for chunk in chunks:
        window = _open(chunk)
        if window is not None:
            window.until_finish = True


def _ddp_chunks(model: Any) -> list[Any]:
    chunks = as_chunks(model)
    bad = [type(chunk).__name__ for chunk in chunks if not hasattr(chunk, "ddp_config")]
    if not chunks or bad:
        raise TypeError(
            "accumulation_window(model): expected a megatron-core DistributedDataParallel chunk or a "
            f"non-empty list of them, got {bad or type(model).__name__}; pass the DDP wrapper, not the "
            "module inside it"
        )
    return chunks


def _close_explicit(window: _Window, failed: bool) -> None:
    window.explicit_depth -= 1
    if window.explicit_depth > 0:
        return
    if failed:  # discard: nothing started, nothing half-reduced, counts cleared
        for group in window.groups:
            _clear_counts(group)
        window.pending = False
    # the reduce waits for the next finish_grad_sync, whose arguments it needs (force_all_reduce),
    # the window deferring until then; after a finish inside, that finish reduces again, as the
    # synchronous path does (upstream's own finish would skip it, or assert, by version)
    window.until_finish = window.pending or (window.finished_inside and not failed)
    if not window.until_finish:
        _uninstall(window)


@contextlib.contextmanager
def accumulation_window(model: Any) -> Iterator[None]:
    """Defer the gradient reduce of `model` (a DDP chunk or a list of chunks) to the window's end.

    Inside the block, backward hooks never start a reduce, whatever the number of schedule calls.
    A `finish_grad_sync` / `finalize_model_grads` inside the block reduces what was accumulated
    so far (as with `overlap_grad_reduce=False`) and the block goes on deferring; gradients
    accumulated since are reduced by the next finish after the block, with its arguments
    (`force_all_reduce`); until then the chunk keeps deferring. Nested
    blocks act at the outermost exit only. If the block raises, nothing is started and the chunks
    are back to upstream behaviour (zero the grad buffers before the next window). Chunks without
    `overlap_grad_reduce` are left alone. Works with or without `apply()`.
    """
    chunks = _ddp_chunks(model)
    windows: list[_Window] = []
    try:
        for chunk in chunks:
            window = _open(chunk)
            if window is not None:
                window.explicit_depth += 1
                windows.append(window)
    except BaseException:
        for window in windows:
            _close_explicit(window, failed=True)
        raise
    failed = True
    try:
        yield
        failed = False
    finally:
        for window in windows:
            _close_explicit(window, failed)
