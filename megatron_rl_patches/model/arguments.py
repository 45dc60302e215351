"""A call's arguments by parameter name, the package's one binder: `bind` (a wrapper reads what the
framework passed, whatever its order), `adapter_arguments` (an adapter that replaces an installed
function takes the arguments it knows), `argument` (one argument read without binding the call) and
`ArgumentsByName` (a forward hook reads and replaces arguments by name, whether passed by position
or by keyword, and hands the call on). Standard library only: every wrapper of the package uses
them, and the patch machinery at start-up."""
from __future__ import annotations

import functools
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


def argument(name: str, position: int, args: tuple, kwargs: dict) -> Any:
    """A wrapped call's argument `name` at `position` (by keyword, else by position; None: not given),
    where a wrapper reads one argument without binding the call."""
    return kwargs[name] if name in kwargs else args[position] if len(args) > position else None


@functools.cache
def positions(function: Callable[..., Any], method: bool = False) -> dict[str, int]:
    """Each positional parameter's index in a call of `function` (`method`: read off the class, its
    `self` left out). The signature is the unwrapped one: a wrapt patch of a forward (like
    `gpt_output_processor`) takes keywords the original does not and passes them on; those never move."""
    parameters = list(inspect.signature(function).parameters.values())[1 if method else 0:]
    return {p.name: i for i, p in enumerate(parameters) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}


class ArgumentsByName:
    """One call's arguments read and replaced by name, whether passed by position or by keyword; the
    call is not bound whole (a name it does not pass reads None, keywords it does not know pass on)."""

    def __init__(self, function: Callable[..., Any], args: tuple, kwargs: dict, *, method: bool = False):
        self.args, self.kwargs = list(args), dict(kwargs)
        self.index = positions(function, method)

    @classmethod
    def of_forward(cls, module: Any, args: tuple, kwargs: dict) -> ArgumentsByName:
        """The arguments of a call of `module`'s forward, as a forward (pre-)hook is given them."""
        return cls(type(module).forward, args, kwargs, method=True)

    def get(self, name: str) -> Any:
        if name in self.kwargs:
            return self.kwargs[name]
        index = self.index.get(name)
        return self.args[index] if index is not None and index < len(self.args) else None

    def set(self, name: str, value: Any) -> None:
        index = self.index.get(name)
        if name not in self.kwargs and index is not None and index < len(self.args):
            self.args[index] = value
        else:
            self.kwargs[name] = value

    def done(self) -> tuple[tuple, dict]:
        """(args, kwargs) to hand the call on with."""
        return tuple(self.args), self.kwargs
