"""A step's plan carried by its data iterators through megatron-core's schedule: a framework hands
the schedule its data iterators, and the schedule hands them, untouched, to the framework's
`forward_step_func(data_iterator, model)` and from there to its batch getter: callbacks of fixed
signatures, so a plan for the step (what a fused model call needs) travels with the iterators
(`planned`), and whoever holds one reads it back (`carried`; the schedule's forward step given
the plan: `planned_schedule`). No module or context variable holds
it. slime's step plan (`integrations.slime.step_plan`) rides on them."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class PlannedIterator:
    """One data iterator with the plan of the step it feeds: `get_next`, `reset` and every other
    attribute are the iterator's own."""

    def __init__(self, iterator: Any, plan: Any):
        self.iterator, self.plan = iterator, plan

    def __getattr__(self, name: str) -> Any:
        if name in ("iterator", "plan"):  # not set yet (a copy being built): no recursion through the wrapped one
            raise AttributeError(name)
        return getattr(self.iterator, name)


def planned(iterators: Any, plan: Any) -> Any:
    """The data iterator(s) (one, or a list: one per virtual stage) carrying `plan` (None: as
    given)."""
    if plan is None or iterators is None:
        return iterators
    if isinstance(iterators, Sequence):
        return [PlannedIterator(iterator, plan) for iterator in iterators]
    return PlannedIterator(iterators, plan)


def carried(iterators: Any) -> Any:
    """The plan a data iterator (or the first of a list) carries; None for a plain one."""
    if isinstance(iterators, Sequence) and not isinstance(iterators, (str, bytes)):
        iterators = iterators[0] if len(iterators) else None
    return iterators.plan if isinstance(iterators, PlannedIterator) else None


def planned_schedule(schedule: Callable[..., Any], step_for: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    """`schedule` (one `get_forward_backward_func()` returned) running `step_for(forward_step_func,
    plan)` as its forward step when its data iterators carry a plan; as it is otherwise."""

    def run(*call_args: Any, **call_kwargs: Any) -> Any:
        plan = carried(call_kwargs.get("data_iterator"))
        if plan is None:
            return schedule(*call_args, **call_kwargs)
        if "forward_step_func" in call_kwargs:
            call_kwargs["forward_step_func"] = step_for(call_kwargs["forward_step_func"], plan)
        elif call_args:
            call_args = (step_for(call_args[0], plan), *call_args[1:])
        return schedule(*call_args, **call_kwargs)

    return run
