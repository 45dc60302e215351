"""Who owns a teacher's privileged-context key: the teacher step, which reads each teacher's key
once, when it is built (`step_teachers`), and from then on passes the keys as arguments (the
batches it builds, the views its ranks compare). A key is declared one of two ways:

- `Privileged(teacher, key)`: the one wrapper that gives any teacher a key without touching it
  (`build_teachers` wraps a host-built teacher of a `;context=KEY` entry in it);
- a teacher built with its own key: `ServedTeacher(..., context=KEY)`, `SelfTeacher(...,
  context=KEY)`, or an in-process teacher's `context` attribute (the documented path of a
  hand-written teacher, kept).

Standard library only."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.teachers.context.key import context_key


@dataclass(frozen=True, eq=False)
class Privileged:
    """`teacher` scoring each sample's privileged context under `context` (the key in the step's
    contexts, `TeacherStep.send(batch, contexts={KEY: ...})`) before the student's response. The
    teacher itself is left as it is: the step unwraps it and scores `with_context(batch, ...)`
    (slime's OPD runs the wrapped teacher's passes over context + response itself: its
    `PrivilegedTeacher` is this wrapper)."""

    teacher: Any
    context: str

    def __post_init__(self) -> None:
        if isinstance(self.teacher, Privileged):
            raise TypeError(f"Privileged(teacher=...) is already {self.teacher!r}: give a teacher one key")
        key = context_key(self.context, "Privileged(context=...)")
        if key is None:
            raise ValueError("Privileged(context=None): a teacher without a privileged context is the teacher itself: "
                             "pass it to the step as it is")
        object.__setattr__(self, "context", key)

    def close(self) -> None:
        """The wrapped teacher's `close()`, where it has one."""
        close = getattr(self.teacher, "close", None)
        if callable(close):
            close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.teacher!r}, context={self.context!r})"


def declared(teacher: Any, index: int) -> tuple[Any, str | None]:
    """Teacher `index` of a step as (the teacher it scores with, its key checked; None: the
    student's own batch)."""
    if isinstance(teacher, Privileged):
        return teacher.teacher, teacher.context
    try:
        own = teacher.context  # a teacher's own key (see the module's words), read here alone
    except AttributeError:
        own = None
    return teacher, context_key(own, f"teacher {index} ({type(teacher).__name__}).context")


def step_teachers(teachers: Sequence[Any]) -> tuple[list[Any], list[str | None]]:
    """The step's teachers unwrapped and their keys, in order (each read once, here)."""
    pairs = [declared(teacher, i) for i, teacher in enumerate(teachers)]
    return [teacher for teacher, _ in pairs], [key for _, key in pairs]
