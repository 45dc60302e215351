"""Logits that carry their step's invariant mode to a framework callback of fixed signature.

slime hands its log-prob callbacks (`get_log_probs_and_entropy`, the loss `func(args, batch,
logits, ...)`) the model's logits and nothing of the step; they reach our
`calculate_log_probs_and_entropy(logits, tokens, tp_group, ...)` squeezed, scaled by the
temperature and made contiguous. :func:`with_mode` marks the logits where the step hands them
over; the mark survives those same-values ops (:data:`KEEPS`) and nothing else: every other
op's result is a plain tensor. :func:`mode_of` reads it (None: unmarked, the route resolves its
own), :func:`plain` gives the tensor back unmarked."""
from __future__ import annotations

import functools
from typing import Any

import torch

# ops whose result holds the same logits (reshaped, moved, cast or scaled): the mark travels
KEEPS = frozenset({
    torch.Tensor.squeeze, torch.Tensor.unsqueeze, torch.Tensor.contiguous, torch.Tensor.view,
    torch.Tensor.reshape, torch.Tensor.float, torch.Tensor.to, torch.Tensor.div, torch.Tensor.__truediv__,
    torch.Tensor.__getitem__, torch.Tensor.detach, torch.squeeze, torch.div,
})


class ModeLogits(torch.Tensor):
    """A logits tensor marked with its step's invariant mode (`invariant`)."""

    invariant: bool | None = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        if func in KEEPS and isinstance(result, torch.Tensor) and isinstance(args[0], ModeLogits):
            return with_mode(result, args[0].invariant)
        return result


def with_mode(logits: Any, invariant: bool | None) -> Any:
    """`logits` (a tensor) marked with `invariant` (the same storage and autograd graph); anything
    else (a fused output dict, None) or a None mode: as given."""
    if invariant is None or not isinstance(logits, torch.Tensor):
        return logits
    with torch._C.DisableTorchFunctionSubclass():
        # already marked: a fresh alias, so the caller's mark is untouched
        marked = (logits.view_as(logits) if isinstance(logits, ModeLogits) else logits).as_subclass(ModeLogits)
    marked.invariant = invariant
    return marked


def mode_of(logits: Any) -> bool | None:
    """The mode `logits` carry; None when unmarked."""
    return logits.invariant if isinstance(logits, ModeLogits) else None


def plain(logits: Any) -> Any:
    """`logits` as a plain tensor (a marked one's alias, the same storage and graph)."""
    if not isinstance(logits, ModeLogits):
        return logits
    with torch._C.DisableTorchFunctionSubclass():
        return logits.as_subclass(torch.Tensor)


def marking(f: Any, invariant: bool | None) -> Any:
    """`f` (a callback taking logits first) handed them marked with `invariant` (`with_mode`); its
    name kept (`functools.wraps`: the framework's wrappers and ours read the callback's name)."""

    @functools.wraps(f)
    def marked(logits: Any, *rest: Any, **options: Any) -> Any:
        return f(with_mode(logits, invariant), *rest, **options)

    return marked
