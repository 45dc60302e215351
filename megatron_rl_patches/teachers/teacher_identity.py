"""What makes two ranks' teachers one teacher (`teacher_identity`), and the first difference
between the ranks' teachers (`identity_difference`): compared over a group before anything is
asked, when a `TeacherStep` is built (`step_views`) and at `ServedTeacher.score(batch, group=...)`
(`agreement.agree_teacher`). Without it a rank of a sharing group holding another served teacher
(another URL, top-k, context key) would read the asking rank's scores as its own, and ranks
scoring with different teachers would train on a mix, with no error.

A served teacher is its replicas' URLs (as a set: each rank may list its nearest first; a URL's
user and password redacted), engine, top-k, temperature, context key and (`head=True`) its head's
facts (`head_fingerprint.head_facts`: the checkpoint's fingerprint, sizes and dtype, a copy at
another path alike); any other teacher its context key (its top-k and temperature are the step's
plan's, compared beside). Small picklable values only: the exchange is one object all-gather."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_rl_patches.teachers.redaction import redacted
from megatron_rl_patches.teachers.replica_urls import SEPARATOR

URLS = "URL(s)"


def teacher_identity(teacher: Any, context: str | None, served: bool, head: bool = True) -> dict[str, Any]:
    """`teacher`'s identity, field by field (see the module's words); `context`: its context key
    (its owner's: the step's, or a `ServedTeacher`'s own); `served`: whether it is a
    `ServedTeacher` (the caller knows: this module imports no client)."""
    fields: dict[str, Any] = {}
    if served:
        fields[URLS] = tuple(sorted(redacted(url) for url in teacher.url.split(SEPARATOR)))
        fields.update({"engine": teacher.engine_name, "top_k": teacher.top_k,
                       "temperature": float(teacher.temperature)})
        if head:
            from megatron_rl_patches.teachers.head.fingerprint import head_facts  # lazy: import cost

            facts = None if teacher.head is None else head_facts(teacher.head)
            fields["head"] = None if facts is None else (str(facts), facts.compared())
    fields["context key"] = context
    return fields


def shown(name: str, value: Any) -> str:
    if name == URLS:
        return SEPARATOR.join(value)
    if name == "head":
        return "no head" if value is None else value[0]
    return repr(value)


def compared(name: str, value: Any) -> Any:
    """What is compared of a field (a head by its facts, not the directory it was read from)."""
    return value[1] if name == "head" and value is not None else value


def identity_difference(ranks: Sequence[int], identities: Sequence[Sequence[dict[str, Any]]],
                        one: bool = False) -> tuple[str, str] | None:
    """The first field in which the ranks' teachers differ and words naming each rank's value
    (`identities`: per rank, its teachers' identities in the step's order; `one`: a single teacher,
    not named by its index), or None. The ranks hold as many teachers (compared before this)."""
    for teacher, ones in enumerate(zip(*identities)):
        for name in ones[0]:
            if len({repr(compared(name, one.get(name))) for one in ones}) > 1:
                values = ", ".join(f"rank {rank}: {shown(name, one.get(name))}" for rank, one in zip(ranks, ones))
                named = "the teacher" if one else f"teacher {teacher}"
                return name, f"{named} differs between the ranks in its {name} ({values})"
    return None
