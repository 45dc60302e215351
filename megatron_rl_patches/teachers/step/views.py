"""What the ranks of a teacher step (`TeacherStep`) compare before its collectives, framework-free:
when it is built, each rank's view (`built_view`: its global rank, the host's vocabulary, its
sharing group's ranks and asking rank, its plan, its teachers' kinds and identities:
`teacher_identity`, a served teacher's URLs, engine, top-k, temperature and context key; `absent_view`
for a rank of the job that holds no step, such as slime's earlier pipeline stages) and, at each
collect, its call's arguments and a digest of each batch it sent (`collect_view`: the student's,
and each privileged context's: a served teacher's context batch is scored by the asking rank
alone, so a rank of its sharing group with other contexts would read scores of contexts it never
passed). `check_built` / `check_collect` refuse a disagreement with the same ValueError on every
rank: each rank checks the same gathered views, so each raises alike, before any rank broadcasts
to a group the others do not hold (the asking rank's scores reach no rank whose batch differs)."""
from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from megatron_rl_patches.teachers.agreement import distributed
from megatron_rl_patches.teachers.asynchronous import AsyncTeacher
from megatron_rl_patches.teachers.teacher_identity import URLS, identity_difference, teacher_identity


def agreement_group(host: Any) -> Any:
    """The group a step's checks and failures are agreed over: the host's job group, else its
    sharing group (whose ranks still wait on each other's broadcast), else None."""
    job = getattr(host, "job_group", None)
    return job if job is not None else getattr(host, "share_group", None)


def global_rank() -> int:
    import torch.distributed as dist  # lazy: import cost: torch only with a group

    return dist.get_rank() if distributed() else 0


def share_ranks(host: Any) -> list[int]:
    """The global ranks of this rank's sharing group, its asking rank first ([this rank] for
    none). ValueError for a group that does not hold this rank."""
    import torch.distributed as dist  # lazy: import cost: torch only with a group

    group = host.share_group
    me = global_rank()
    if group is None or not distributed():
        return [me]
    if dist.get_rank(group) < 0:
        raise ValueError(f"TeacherStep(host=...): host.share_group does not hold this rank ({me}): pass the group of "
                         "the ranks that hold this rank's samples (the tensor / context-parallel group), or None")
    return [int(r) for r in dist.get_process_group_ranks(group)]


def teacher_kind(teacher: Any) -> str:
    if isinstance(teacher, AsyncTeacher):
        return "served with a head" if teacher.head is not None else "served"
    return "in-process"


def built_view(host: Any, teachers: Sequence[Any], keys: Sequence[str | None], plan: Any) -> dict:
    """This rank's view of a step it builds (its local checks passed; `keys`: its teachers' context
    keys)."""
    return {"call": "TeacherStep build", "rank": global_rank(), "vocab_size": host.vocab_size,
            "share": share_ranks(host),
            "plan": (plan.top_k, float(plan.temperature), plan.invariant),
            "teachers": [teacher_kind(t) for t in teachers],
            # a head is compared over the sharing group by step_heads (its facts, its vocabulary against the host's)
            "identity": [teacher_identity(t, key, teacher_kind(t) != "in-process", head=False)
                         for t, key in zip(teachers, keys)]}


def absent_view(host: Any) -> dict:
    """The view of a rank of the job that holds no step (it shares and asks nothing)."""
    return {"call": "TeacherStep build", "rank": global_rank(), "vocab_size": getattr(host, "vocab_size", None)}


def by_rank(views: list[dict], key: str) -> str:
    return ", ".join(f"rank {view['rank']}: {view[key]}" for view in views)


def check_built(views: list[dict]) -> None:
    """ValueError, alike on every rank, where the ranks' views of a step disagree."""
    if len({repr(view["vocab_size"]) for view in views}) > 1:
        raise ValueError(f"TeacherStep: host.vocab_size differs between the ranks ({by_rank(views, 'vocab_size')}): "
                         "pass the student's real vocabulary, the same on every rank")
    holding = [view for view in views if "share" in view]
    for key, what in (("plan", "(top_k, temperature, invariant)"), ("teachers", "teachers")):
        if len({repr(view[key]) for view in holding}) > 1:
            raise ValueError(f"TeacherStep: the {what} differ between the ranks ({by_rank(holding, key)}): build "
                             "the same teachers, in the same order, on every rank")
    differs = identity_difference([view["rank"] for view in holding], [view["identity"] for view in holding])
    if differs:
        field, words = differs
        raise ValueError(f"TeacherStep: {words}: build the same teachers, in the same order, on every rank"
                         + (" (a served teacher's replicas: all of them on every rank)" if field == URLS else ""))
    shares = {view["rank"]: view["share"] for view in holding}
    for view in holding:
        strays = [rank for rank in view["share"] if shares.get(rank) != view["share"]]
        if strays:
            told = ", ".join(f"rank {rank} with {shares[rank]}" if rank in shares else f"rank {rank} builds no step"
                             for rank in strays)
            raise ValueError(f"TeacherStep: the ranks' sharing groups (host.share_group) disagree: rank "
                             f"{view['rank']} shares with ranks {view['share']} (asked by rank {view['share'][0]}), "
                             f"but {told}: every rank of a sharing group must pass that same group (its first rank "
                             "asks the served teachers and broadcasts their scores to the others)")


def batch_fingerprint(batch: Any) -> tuple:
    """A sent batch in a few numbers: its lengths, its response starts and a crc32 of its ids."""
    import torch  # lazy: import cost: torch only where a batch is sent

    ids = torch.cat([s.detach().reshape(-1).long().cpu() for s in batch.sequences]) if len(batch) else None
    return (tuple(len(s) for s in batch.sequences), tuple(batch.response_starts),
            0 if ids is None else zlib.crc32(ids.numpy().tobytes()))


def served_contexts(teachers: Sequence[Any], keys: Sequence[str | None],
                    batches: Sequence[Any]) -> list[tuple[int, str, Any]]:
    """(index, context key, batch) of each served teacher with a privileged context (`keys`: the
    step's): the batches the asking rank alone sends (`with_context`: its contexts before the
    responses)."""
    return [(i, key, batches[i]) for i, (teacher, key) in enumerate(zip(teachers, keys))
            if isinstance(teacher, AsyncTeacher) and key is not None]


def collect_view(projected: bool, asker: int, batch: Any, scored: Any = (),
                 sent: Sequence[tuple[int, str, Any]] = ()) -> dict:
    """A rank's collect: its arguments, the batch it sent, (`scored`) the batches its in-process
    teachers score (a privileged teacher's: its contexts before the responses) and (`sent`:
    `served_contexts`) the served teachers' context batches, each key's digested once."""
    digests: dict[str, tuple] = {}
    contexts = tuple((i, key, digests.setdefault(key, batch_fingerprint(one))) for i, key, one in sent)
    return {"call": "TeacherStep.collect", "rank": global_rank(), "projected": projected, "asker": asker,
            "batch": batch_fingerprint(batch), "scored": tuple(batch_fingerprint(one) for one in scored),
            "contexts": contexts}


def digest_words(fingerprint: tuple) -> str:
    return f"lengths {list(fingerprint[0])}, starts {list(fingerprint[1])}, ids crc32 {fingerprint[2]}"


def check_collect(views: list[Any]) -> None:
    """ValueError, alike on every rank, where the ranks called `collect` differently, or the ranks
    of a sharing group sent different batches (each would read the asking rank's scores)."""
    holding = [view for view in views if view is not None]
    if len({view["projected"] for view in holding}) > 1:
        raise ValueError(f"TeacherStep.collect: projected differs between the ranks ({by_rank(holding, 'projected')}"
                         "): pass the same on every rank (a head's projection runs over every rank of its group)")
    for asker in sorted({view["asker"] for view in holding}):
        group = [view for view in holding if view["asker"] == asker]
        if len({view["batch"] for view in group}) > 1:
            shown = ", ".join(f"rank {view['rank']}: {digest_words(view['batch'])}" for view in group)
            raise ValueError(f"TeacherStep.send: the ranks of the sharing group asked by rank {asker} sent different "
                             f"batches ({shown}): every rank of a sharing group sends the same samples (they all read "
                             "the asking rank's scores)")
        if len({view["scored"] for view in group}) > 1:
            shown = ", ".join(f"rank {view['rank']}: " + "; ".join(digest_words(one) for one in view["scored"])
                              for view in group)
            raise ValueError(f"TeacherStep.send: the ranks of the sharing group asked by rank {asker} sent different "
                             f"privileged contexts for the in-process teachers ({shown}): every rank of a sharing "
                             "group passes the same contexts (their model-parallel pass runs over every rank)")
        check_served_contexts(asker, group)


def check_served_contexts(asker: int, group: list[dict]) -> None:
    """ValueError where the ranks of one sharing group (`group`: their views) sent a served
    teacher different privileged contexts, naming the teacher, its key and each rank's digest."""
    for position, (teacher, key, _) in enumerate(group[0]["contexts"]):
        seen = [view["contexts"][position] if position < len(view["contexts"]) else None for view in group]
        if len({repr(one) for one in seen}) > 1:
            shown = ", ".join(f"rank {view['rank']}: " + ("none" if one is None else digest_words(one[2]))
                              for view, one in zip(group, seen))
            raise ValueError(f"TeacherStep.send: the ranks of the sharing group asked by rank {asker} sent different "
                             f"privileged contexts for served teacher {teacher} (context {key!r}; the batch it "
                             f"scores, context + response: {shown}): every rank of a sharing group passes the same "
                             "contexts (the asking rank alone asks; the others read its scores)")
