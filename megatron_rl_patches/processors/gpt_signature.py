"""The wrapper class installed by `gpt_output_processor`: GPTModel.forward reports the keywords
the backport accepts, so code that detects the hook by signature sees it.

verl 0.9.1 (`verl/models/mcore/model_forward_fused.py::_supports_output_processor_hook`) picks
its fused route from `inspect.signature(model.forward)`, which follows `__wrapped__` to
megatron's own function unless the wrapper answers `__signature__` itself. The signature comes
from the wrapper class, never set on megatron's function, so `revert()` leaves nothing behind; a
wrapper captured before `revert()` reports the original signature again once it is inactive.
"""
from __future__ import annotations

import inspect
from typing import Any

from megatron_rl_patches.patching import wrappers

KEYWORDS = ("output_processor", "output_processor_context")


def with_processor_keywords(signature: inspect.Signature) -> inspect.Signature:
    """`signature` with keyword-only `output_processor=None, output_processor_context=None`
    (before a `**kwargs` parameter, as Python requires), unless it has them already."""
    params = list(signature.parameters.values())
    if all(name in signature.parameters for name in KEYWORDS):
        return signature
    var_kw = [p for p in params if p.kind is p.VAR_KEYWORD]
    rest = [p for p in params if p.kind is not p.VAR_KEYWORD]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
             for name in KEYWORDS if name not in signature.parameters]
    return signature.replace(parameters=[*rest, *added, *var_kw])


def _signature(wrapped: Any, parent: wrappers.FunctionWrapper) -> inspect.Signature:
    original = inspect.signature(wrapped)
    return with_processor_keywords(original) if parent.patch_active() else original


class _BoundOutputProcessorForward(wrappers.BoundFunctionWrapper):
    @property
    def __signature__(self) -> inspect.Signature:
        # class access wraps the plain function (self included); instance access a bound method;
        # `_self_parent`: the unbound wrapper wrapt binds this one from
        return _signature(self.__wrapped__, self._self_parent)

    @property
    def __func__(self) -> Any:
        # inspect.signature treats a bound proxy as a method and reads __func__: give it the
        # unbound wrapper (which answers __signature__), not megatron's function
        if not hasattr(self.__wrapped__, "__func__"):
            raise AttributeError("__func__")
        return self._self_parent


class OutputProcessorForward(wrappers.FunctionWrapper):
    """Our FunctionWrapper whose signature includes the backported keywords while active."""

    __bound_function_wrapper__ = _BoundOutputProcessorForward

    @property
    def __signature__(self) -> inspect.Signature:
        return _signature(self.__wrapped__, self)
