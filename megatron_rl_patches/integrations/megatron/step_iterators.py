"""What a training step's fused model call needs, carried by its data iterators through megatron-core's
schedule: a framework hands the schedule its data iterators, and the schedule hands them, untouched,
to the framework's `forward_step_func(data_iterator, model)` and from there to its batch getter:
callbacks of fixed signatures, so the step's description (any object: slime's `FusedStep`) travels
with the iterators (`carrying`), and whoever holds one reads it back (`carried`; the schedule's
forward step given it: `schedule_with_step`). No module or context variable holds it."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class StepIterator:
    """One data iterator with the description of the step it feeds: `get_next`, `reset` and every other
    attribute are the iterator's own."""

    def __init__(self, iterator: Any, step: Any):
        self.iterator, self.step = iterator, step

    def __getattr__(self, name: str) -> Any:
        if name in ("iterator", "step"):  # not set yet (a copy being built): no recursion through the wrapped one
            raise AttributeError(name)
        return getattr(self.iterator, name)


def carrying(iterators: Any, step: Any) -> Any:
    """The data iterator(s) (one, or a list: one per virtual stage) carrying `step` (None: as
    given)."""
    if step is None or iterators is None:
        return iterators
    if isinstance(iterators, Sequence):
        return [StepIterator(iterator, step) for iterator in iterators]
    return StepIterator(iterators, step)


def carried(iterators: Any) -> Any:
    """The step a data iterator (or the first of a list) carries; None for a plain one."""
    if isinstance(iterators, Sequence) and not isinstance(iterators, (str, bytes)):
        iterators = iterators[0] if len(iterators) else None
    return iterators.step if isinstance(iterators, StepIterator) else None


def schedule_with_step(schedule: Callable[..., Any], step_for: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    """`schedule` (one `get_forward_backward_func()` returned) running `step_for(forward_step_func,
    step)` as its forward step when its data iterators carry a step; as it is otherwise."""

    def run(*call_args: Any, **call_kwargs: Any) -> Any:
        step = carried(call_kwargs.get("data_iterator"))
        if step is None:
            return schedule(*call_args, **call_kwargs)
        if "forward_step_func" in call_kwargs:
            call_kwargs["forward_step_func"] = step_for(call_kwargs["forward_step_func"], step)
        elif call_args:
            call_args = (step_for(call_args[0], step), *call_args[1:])
        return schedule(*call_args, **call_kwargs)

    return run
