"""Non-reentrant activation checkpointing for loss functions.

The re-entrant variant ignores inputs that do not require grad (parameters used inside get no
gradient), breaks with keyword arguments and nested structures; ``use_reentrant=False`` has none
of these limits.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint

__all__ = ["checkpoint_loss", "checkpointed"]

R = TypeVar("R")


def checkpoint_loss(fn: Callable[..., R], /, *args: Any, preserve_rng_state: bool = True, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)`` with its activations dropped after forward and recomputed in backward.

    Keyword and non-tensor arguments are passed through untouched (bound with a partial, so
    they cannot clash with torch's own checkpoint options); inputs that do not require grad
    work. Without grad mode it is a plain call.
    """
    if not callable(fn):
        raise TypeError(f"checkpoint_loss needs a callable as its first argument, got {type(fn).__name__}")
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    bound = functools.partial(fn, **kwargs) if kwargs else fn
    return torch.utils.checkpoint.checkpoint(
        bound, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state
    )


def checkpointed(fn: Callable[..., R]) -> Callable[..., R]:
    """Decorator form of :func:`checkpoint_loss`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> R:
        return checkpoint_loss(fn, *args, **kwargs)

    return wrapper
