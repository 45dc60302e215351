"""A wrapped call's arguments by parameter name: `bind` (a wrapper reads what the framework passed,
whatever its order) and `adapter_arguments` (an adapter that replaces an installed function takes
the arguments it knows). Standard library only: every wrapper of the package uses them."""
from __future__ import annotations

import inspect
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
