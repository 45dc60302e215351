"""wrapt function wrappers that pickle, copy and deep-copy like what they wrap.

wrapt's proxies refuse all three (`object proxy must define __reduce__()`), yet Ray and
multiprocessing pickle functions and bound methods. A wrapper of a plain function reduces to a
lookup of the function's own module and qualified name, as pickle stores the function itself
(the loading process gets whatever lives at that path: patched or not); copying returns it
unchanged, as for a function. A wrapper of anything else (a bound method) reduces and copies
like that object (a bound method: `getattr(its object, name)`).
"""
from __future__ import annotations

import copy
import pkgutil
import types
from typing import Any, Callable

import wrapt


class _Reducible:
    """Pickling and copying for wrapt's function wrappers (mixed in before them)."""

    __wrapped__: Any

    def __reduce_ex__(self, protocol: int) -> Any:
        wrapped = self.__wrapped__
        if isinstance(wrapped, types.FunctionType):
            return pkgutil.resolve_name, (f"{wrapped.__module__}:{wrapped.__qualname__}",)
        return wrapped.__reduce_ex__(protocol)

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)

    def __copy__(self) -> Any:
        if isinstance(self.__wrapped__, types.FunctionType):
            return self
        rebuild, args = self.__reduce_ex__(4)[:2]
        return rebuild(*args)

    def __deepcopy__(self, memo: dict) -> Any:
        if isinstance(self.__wrapped__, types.FunctionType):
            return self
        rebuild, args = self.__reduce_ex__(4)[:2]
        return rebuild(*copy.deepcopy(args, memo))


class BoundFunctionWrapper(_Reducible, wrapt.BoundFunctionWrapper):
    """What a :class:`FunctionWrapper` becomes when looked up on a class or an instance."""


class FunctionWrapper(_Reducible, wrapt.FunctionWrapper):
    """A wrapt FunctionWrapper that pickles and copies like the function it wraps."""

    __bound_function_wrapper__ = BoundFunctionWrapper


def wrap(owner: Any, attribute: str, wrapper: Callable[..., Any]) -> FunctionWrapper:
    """`wrapt.wrap_function_wrapper` with a :class:`FunctionWrapper`; `wrapt.unwrap_object` removes it."""
    return wrapt.wrap_object(owner, attribute, FunctionWrapper, (wrapper,))
