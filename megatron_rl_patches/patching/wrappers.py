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
from collections.abc import Callable
from typing import Any, SupportsIndex

import wrapt


class _Reducible:
    """Pickling and copying for wrapt's function wrappers (mixed in before them)."""

    __wrapped__: Any

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
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


Key = tuple[str, str]  # (patch name, target): which record installed a wrapper


class FunctionWrapper(_Reducible, wrapt.FunctionWrapper):
    """A wrapt FunctionWrapper that pickles and copies like the function it wraps, and carries the
    key of the record that installed it (see :func:`patch_key`)."""

    __bound_function_wrapper__ = BoundFunctionWrapper

    def __init__(self, wrapped: Any, wrapper: Callable[..., Any], enabled: Any = None, key: Key | None = None):
        super().__init__(wrapped, wrapper, enabled)
        # wrapt's documented way to keep an attribute on the proxy itself (not on the wrapped
        # function): a name starting with `_self_`; its bound wrappers read it from here.
        self._self_patch_key = key
        self._self_patch_enabled = enabled

    def patch_active(self) -> bool:
        """Whether the wrapper function runs now (`enabled` given to :func:`wrap`, called)."""
        enabled = self._self_patch_enabled
        return True if enabled is None else bool(enabled() if callable(enabled) else enabled)


def patch_key(obj: Any) -> Key | None:
    """The key given to :func:`wrap` when `obj` is one of our wrappers (or one bound from it),
    else None. By type: a foreign proxy over ours would forward the attribute lookup."""
    if isinstance(obj, (FunctionWrapper, BoundFunctionWrapper)):
        return obj._self_patch_key
    return None


def wrap(owner: Any, attribute: str, wrapper: Callable[..., Any], *, enabled: Callable[[], bool] | None = None,
         key: Key | None = None, wrapper_class: type[FunctionWrapper] = FunctionWrapper) -> FunctionWrapper:
    """`wrapt.wrap_function_wrapper` with a :class:`FunctionWrapper` (or a subclass): `wrapper` runs
    while `enabled()` is true (else the original is called), `key` names the record;
    `wrapt.unwrap_object` removes it."""
    return wrapt.wrap_object(owner, attribute, wrapper_class, (wrapper,), {"enabled": enabled, "key": key})
