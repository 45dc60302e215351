"""Argument helpers shared by the wrappers and the public functions: binding a wrapped call to
its signature, and checking positive integer arguments. Imports nothing heavy."""
from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from typing import Any


def bind(wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    """Arguments of a call by parameter name (defaults applied), or None when the call does not
    fit the signature (or it has none): the caller then runs the original, which raises its own
    TypeError."""
    try:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return bound


def positive_int(name: str, value: Any, meaning: str = "") -> int:
    """`value` as an int when it is an integer >= 1 (bool excluded, numpy integers accepted);
    ValueError naming `name` (and what it means) otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int{meaning}, got {value!r}")
    return int(value)


class CheckedK(int):
    """A top-k size checked (a positive int) where the settings were parsed or the processor
    built: the ops inside take it as it is. Made only by :func:`checked_k` or by a parser that ran
    the same check (slime's MEGATRON_RL_PATCHES_OPD_K)."""

    __slots__ = ()


def checked_k(k: Any, meaning: str = "") -> CheckedK:
    """`k` checked once: a :class:`CheckedK` as it is, anything else through :func:`positive_int`
    (ValueError naming ``k``)."""
    return k if isinstance(k, CheckedK) else CheckedK(positive_int("k", k, meaning))
