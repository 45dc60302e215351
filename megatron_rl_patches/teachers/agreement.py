"""A served teacher's failure agreed over the ranks of a job (`agree_failure`): when any rank's
step failed, every rank raises the same error, so no healthy rank waits in a later collective.
The exchange is the agreement home's (`ops.agreement.gathered_objects`: its device rule)."""
from __future__ import annotations

from megatron_rl_patches.teachers.errors import ServedTeacherError, ServedTeacherRefusal


def agree_failure(error: BaseException | None, group: object = None) -> None:
    """Raise on every rank of `group` the lowest failing rank's error (a `ServedTeacherError`; a
    `ServedTeacherRefusal` for a refusal or a bad argument) when any rank passes one; return on every rank when none
    does. Without a group, or torch.distributed not initialized: `error` raised here as it is.
    Every rank of the group must call it (one all-gather)."""
    if group is None or not distributed():
        if error is not None:
            raise error
        return
    # lazy: import cost: torch only when a group is given
    from megatron_rl_patches.ops.agreement import gathered_objects

    refused = isinstance(error, (ValueError, TypeError))
    said = None if error is None else (refused, f"{type(error).__name__}: {error}", getattr(error, "url", ""),
                                       getattr(error, "sample", None))
    gathered: list = gathered_objects(group, said)
    failed = [(rank, words) for rank, words in enumerate(gathered) if words is not None]
    if not failed:
        return
    rank, (refusal, words, url, sample) = failed[0]
    kind = ServedTeacherRefusal if refusal else ServedTeacherError
    others = f" ({len(failed)} of {len(gathered)} ranks failed)" if len(failed) > 1 else ""
    raise kind(f"served teacher failed on rank {rank} of the group{others}: {words}", url, sample) from error


def distributed() -> bool:
    try:
        import torch.distributed as dist  # lazy: import cost: torch only when a group is given
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()
