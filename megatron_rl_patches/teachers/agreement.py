"""A served teacher's failure agreed over the ranks of a job (`agree_failure`): when any rank's
step failed, every rank raises the same error, so no healthy rank waits in a later collective.
`agreed_views` is the same exchange carrying each rank's view of the step (its groups, its
vocabulary, its call's arguments), for the checks that must compare the ranks; a caller's own bad
call (`own=True`) is raised on every rank as its own kind (TypeError, ValueError, RuntimeError).
`agree_teacher` compares the ranks' teachers (`teacher_identity`) before a direct
`ServedTeacher.score(batch, group=...)` asks anything.
The exchange is the agreement home's (`ops.agreement.gathered_objects`: its device rule)."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.teachers.errors import ServedTeacherError, ServedTeacherRefusal
from megatron_rl_patches.teachers.teacher_identity import URLS, identity_difference, teacher_identity

JOINED_BY_NONE = {"TeacherStep.collect"}
OWN_KINDS: dict[str, type[Exception]] = {kind.__name__: kind for kind in (TypeError, ValueError, RuntimeError)}


def agree_failure(error: BaseException | None, group: object = None, *, own: bool = False,
                  what: str | None = None) -> None:
    """Raise on every rank of `group` the lowest failing rank's error (a `ServedTeacherError`; a
    `ServedTeacherRefusal` for a refusal or a bad argument; with `own` on that rank, the caller's
    bad call: its own kind; with `what`, a ValueError saying what failed there, e.g. a loop's
    "the privileged contexts") when any rank passes one; return on every rank when none does.
    Without a group, or torch.distributed not initialized: `error` raised here as it is. Every
    rank of the group must call it (one all-gather)."""
    agreed_views(error, group, None, own=own, what=what)


def agreed_views(error: BaseException | None, group: object, view: Any, *, own: bool = False,
                 what: str | None = None) -> list[Any]:
    """Every rank's picklable `view`, in the group's rank order, once no rank passed an `error`
    (else `agree_failure`'s error, on every rank). `[view]` without a group to agree over."""
    if group is None or not distributed():
        if error is not None:
            raise error
        return [view]
    # lazy: import cost: torch only when a group is given
    from megatron_rl_patches.ops.agreement import gathered_objects

    said = None
    if error is not None:
        own_kind = next((name for name, known in OWN_KINDS.items() if isinstance(error, known)), "RuntimeError")
        said = (isinstance(error, (ValueError, TypeError)), f"{type(error).__name__}: {error}",
                getattr(error, "url", ""), getattr(error, "sample", None), (own_kind, str(error)) if own else None)
    gathered: list = gathered_objects(group, (said, view))
    failed = [(rank, told) for rank, (told, _) in enumerate(gathered) if told is not None]
    if not failed:
        check_calls([seen for _, seen in gathered])
        return [seen for _, seen in gathered]
    rank, (refusal, words, url, sample, called) = failed[0]
    ranks = [r for r, _ in failed]
    if called is not None:
        kind_name, text = called
        raise OWN_KINDS[kind_name](f"{text} [refused on rank(s) {ranks} of the group's {len(gathered)} ranks, so on "
                                   "every rank]") from error
    others = f" ({len(failed)} of {len(gathered)} ranks failed)" if len(failed) > 1 else ""
    if what is not None:
        raise ValueError(f"{what} failed on rank {rank}{others}: {words}") from error
    kind = ServedTeacherRefusal if refusal else ServedTeacherError
    raise kind(f"served teacher failed on rank {rank} of the group{others}: {words}", url, sample) from error


def agree_teacher(teacher: Any, group: object, where: str = "ServedTeacher.score") -> None:
    """Every rank of `group` holds the same served teacher (its URLs, engine, top-k, temperature, head
    and context key: `teacher_identity`), else the same ValueError on every rank naming each rank's
    value of the first field that differs; nothing without a group. One object all-gather, before
    anything is asked (each rank would otherwise score with its own teacher, a mix of teachers
    over the group). The batches are not compared: a data-parallel group's ranks score their own."""
    if group is None or not distributed():
        return
    import torch.distributed as dist  # lazy: import cost: torch only when a group is given

    mine = teacher_identity(teacher, teacher.context, served=True)
    views = agreed_views(None, group, {"call": where, "rank": dist.get_rank(), "teacher": mine})
    differs = identity_difference([view["rank"] for view in views], [[view["teacher"]] for view in views], one=True)
    if differs:
        field, words = differs
        raise ValueError(f"{where}(group=...): {words}: build the same teacher on every rank of the group"
                         + (" (its replicas: all of them on every rank, joined by '|')" if field == URLS else ""))


def check_calls(views: list[Any]) -> None:
    """RuntimeError, alike on every rank, where the ranks are in different calls: a view's `call`
    names its call; a rank without a view (`agree_failure`) meets only a call that takes such
    ranks (`JOINED_BY_NONE`: a teacher step's collect, which the ranks holding no step join)."""
    calls = [view.get("call") if isinstance(view, dict) else None for view in views]
    named = set(calls) - {None}
    if len(named) > 1 or (named and None in calls and not named <= JOINED_BY_NONE):
        shown = ", ".join(f"rank {rank}: {call or 'a failure agreement (agree_failure)'}"
                          for rank, call in enumerate(calls))
        raise RuntimeError(f"the ranks of the group are in different calls ({shown}): every rank of the job builds "
                           "the teacher step (or joins its build with teachers.step.teacher_step.join_build(host)), "
                           "then sends and collects in the same order")


def distributed() -> bool:
    try:
        import torch.distributed as dist  # lazy: import cost: torch only when a group is given
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()
