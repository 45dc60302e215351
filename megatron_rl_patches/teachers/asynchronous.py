"""A teacher asked in the background (`AsyncTeacher`), as the teacher step asks it: `submit(batch)`
on the asking rank of a sharing group sends at once and returns a `Pending`, whose `result()`
collects after the student's forward (a failure agreed over a group); what came back is shared
with the group, and `project(batch, got)` turns it into the step's scores on every rank (a head's
hidden states through the head, whose tensor-parallel ops need every rank; scores as they came
otherwise). `ServedTeacher` is one; a teacher without `submit` is asked in-process on every rank.
The step tells the kinds apart by this protocol alone, never by a teacher's class."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.teachers.batch import TeacherBatch
    from megatron_rl_patches.teachers.contract import BatchScores


class Pending(Protocol):
    """One batch in flight."""

    def result(self, group: object = None, *, projected: bool = True) -> Any:
        """What came back (`projected=False`: before `project`), a failure raised alike on every rank
        of `group`."""
        ...

    def cancel(self) -> None:
        """Stop what is in flight (the step failed elsewhere)."""
        ...


@runtime_checkable
class AsyncTeacher(Protocol):
    """A teacher the step asks on one rank and shares (see the module's words)."""

    top_k: int
    head: Any  # what turns its hidden states into scores (None: it answers scores)

    def submit(self, batch: TeacherBatch) -> Pending: ...

    def project(self, batch: TeacherBatch, got: Any) -> BatchScores: ...
