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


def adapter_arguments(adapter: Callable[..., Any], wrapped: Callable[..., Any], args: tuple,
                      kwargs: dict) -> tuple[dict[str, Any] | None, list[str]]:
    """A call of `wrapped` (an installed function an adapter replaces) bound to `wrapped`'s own
    signature (forks order and name parameters differently; the adapter's where `wrapped` takes
    *args / **kwargs), its defaults applied: the arguments `adapter` takes, and the names of those
    it does not take given a non-default value (the caller then runs `wrapped`). (None, []): the
    call does not fit (`wrapped` raises its own error)."""
    known = inspect.signature(adapter).parameters
    signature = inspect.signature(wrapped)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        signature = inspect.signature(adapter)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None, []
    bound.apply_defaults()
    foreign = [name for name, value in bound.arguments.items()
               if name not in known and value is not signature.parameters[name].default]
    return {name: value for name, value in bound.arguments.items() if name in known}, foreign


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
