"""The invariant mode of the framework step under way, resolved once from the student's model
config where a framework hands a patched caller the model (slime's `forward_only`,
`train_one_step` and the actor's `train_actor`, verl's engine `forward_step`): the routes inside the
step that get logits, tokens and a group only (slime's log-prob adapter and OPD loss, verl's top-k
loss) and the teachers scored beside the student take it from here as a bool."""
from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from megatron_rl_patches._chunks import as_chunks, unwrap
from megatron_rl_patches.ops.invariance import resolve_invariant

_MODE: contextvars.ContextVar[bool | None] = contextvars.ContextVar("megatron_rl_patches_step_invariant",
                                                                    default=None)


def model_config(model: Any) -> Any:
    """The config of a model or its first chunk (through DDP / Float16Module wrappers); None without one."""
    chunks = as_chunks(model)
    return getattr(unwrap(chunks[0]), "config", None) if chunks and chunks[0] is not None else None


def student_invariant(model: Any) -> bool:
    """The invariant mode of a step handed the student `model`: the setting, else its config's
    ``batch_invariant_mode`` (resolved once there, then passed down as an argument)."""
    config = model_config(model)
    return resolve_invariant(None, config)


def step_invariant() -> bool | None:
    """The invariant mode of the step under way; None outside one (the route resolves its own)."""
    return _MODE.get()


@contextmanager
def student_mode(model: Any) -> Iterator[bool]:
    """Inside: the step's mode, the setting or else `model`'s config's ``batch_invariant_mode``;
    an enclosing step's mode is kept (a teacher's or a role's pass inside the student's step
    follows the student)."""
    outer = _MODE.get()
    if outer is not None:
        yield outer
        return
    mode = student_invariant(model)
    token = _MODE.set(mode)
    try:
        yield mode
    finally:
        _MODE.reset(token)


def run_in_student_mode(model: Any, wrapped: Any, args: tuple, kwargs: dict) -> Any:
    """`wrapped(*args, **kwargs)` inside :func:`student_mode` of `model`."""
    with student_mode(model):
        return wrapped(*args, **kwargs)
