"""slime's OPD builder for a served teacher (`http://host:port;engine=vllm`, the `served` row of
`teachers.kinds`): a `served_opd.ServedOpdTeacher` over its framework-free role
(`teachers.step.served`), and the settings it needs, checked before anything loads
(`served_checks.check_served`): a served engine scores its own top-k only, so the buckets come from it
(MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher, the served teacher first); one with another tokenizer
(`;tokenizer=DIR`) scores its own encoding, one with a head (`;head=DIR`: hidden states) any ids.
The server is asked at load by the rank that will ask it (`teachers.served.connect`)."""
# lazy imports: optional dependency megatron-core (and httpx, the extra `served`)
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd.cross_passes import cross_pair
from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, OpdSettings, Teacher
from megatron_rl_patches.integrations.megatron.opd.served_checks import check_served
from megatron_rl_patches.integrations.megatron.opd.served_opd import ServedOpdTeacher
from megatron_rl_patches.integrations.megatron.opd.stage_host import (
    StageHost,
    rollout_temperature,
    stage_host,
    student_tokenizer_of,
    tp_group,
)
from megatron_rl_patches.teachers.named_vocab import named_vocab_size
from megatron_rl_patches.teachers.served.connect import NamedVocab, connect_served
from megatron_rl_patches.teachers.served.tokenizer_probe import STUDENTS
from megatron_rl_patches.teachers.step.served import CrossServed, HeadServed, OwnTopkServed


def build_served_teacher(actor: Any, settings: OpdSettings, index: int, teacher: Teacher, student: int | str,
                         route: str) -> ServedOpdTeacher:
    """The served teacher of `teacher` for slime's actor, built on the last pipeline stage's ranks:
    the server asked (it answers, K within its --max-logprobs, its tokenizer: the student's, or the
    one `;tokenizer=DIR` names) by the rank that will ask it, agreed by all."""
    check_served(settings)
    where = f"{TEACHERS} entry '{teacher.path}'"
    unwrapped = actor.model[-1]
    while hasattr(unwrapped, "module"):  # the wrapped chunk (DDP, Float16Module) holds the vocabulary
        unwrapped = unwrapped.module
    host = stage_host(int(unwrapped.vocab_size))
    if teacher.head is not None:  # with ';tokenizer=DIR' too: exact buckets through the head
        role: Any = served_head(actor.args, settings, teacher, student, host, where)
    elif teacher.tokenizer is not None:
        role = served_cross(actor.args, settings, teacher, host, where)
    else:
        named = named_vocab_size(teacher, where) if teacher.same_tokenizer else None
        role = served_own(actor.args, settings, teacher, host, where, named)
    cross = teacher.tokenizer is not None  # another tokenizer: its own encodings sent after their contexts
    return ServedOpdTeacher(role if host.last else None, host, cross=cross, context=teacher.context)


def named_or_none(args: Any, named: int | None, where: str) -> NamedVocab | None:
    """The entry's `;same_tokenizer` vocabulary against the ids the student's tokenizer writes."""
    if named is None:
        return None
    return lambda: (named, int(student_tokenizer_of(args, where).get_vocab_size(with_added_tokens=True)))


def students(args: Any, where: str) -> Any:
    """The student's tokenizer, read when the probe runs (on the asking rank)."""
    return lambda: (student_tokenizer_of(args, where), STUDENTS)


def served_own(args: Any, settings: OpdSettings, teacher: Teacher, host: StageHost, where: str,
               named: int | None = None) -> OwnTopkServed | None:
    """A served teacher of the student's tokenizer (`named`: the entry's `;same_tokenizer`
    vocabulary, for a server without a tokenizer to probe)."""
    from megatron_rl_patches.teachers.served.build import served_teacher_of  # lazy: optional dependency httpx
    from megatron_rl_patches.teachers.served.client import ServedTeacher  # lazy: optional dependency httpx

    def build() -> ServedTeacher | None:
        # its context key is its `ServedOpdTeacher`'s, the one owner of a slime served teacher's key
        return served_teacher_of(teacher.without_context(), settings.plan()) if host.last else None

    served = connect_served(build, where,
                            asks=host.asks, job_group=host.job_group, tokenizer=students(args, where),
                            named_vocab=named_or_none(args, named, where))
    return None if served is None else OwnTopkServed(served, host.vocab_size)


def served_cross(args: Any, settings: OpdSettings, teacher: Teacher, host: StageHost,
                 where: str) -> CrossServed | None:
    """A served teacher of another tokenizer (`;tokenizer=DIR`): the pair read on the last stage's
    ranks (each encodes the samples), the server checked to share DIR's tokenizer."""
    from megatron_rl_patches.teachers.served.build import served_teacher_of  # lazy: optional dependency httpx
    from megatron_rl_patches.teachers.served.client import ServedTeacher  # lazy: optional dependency httpx

    pairs: list = []

    def build() -> ServedTeacher | None:
        if not host.last:
            return None
        pairs.append(cross_pair(args, teacher))
        # its context is sent before its own encoding by `ServedOpdTeacher`, not by the client
        return served_teacher_of(teacher.without_context(), settings.plan())

    whose = f"the tokenizer ';tokenizer={teacher.tokenizer}' names"
    served = connect_served(build, where, asks=host.asks, job_group=host.job_group,
                            tokenizer=lambda: (pairs[0].tokenizer, whose))
    return None if served is None else CrossServed(served, pairs[0], settings.top_k)


def served_head(args: Any, settings: OpdSettings, teacher: Teacher, student: int | str, host: StageHost,
                where: str) -> HeadServed | CrossServed | None:
    """The teacher of `;head=DIR`: DIR's vocabulary checked against the student's (every rank; with
    `;tokenizer=DIR` another tokenizer: its pair read on the last stage's ranks instead, each
    encoding the samples, every chunk-start bucket scored exactly through the head), its head read
    on the last pipeline stage's ranks (this rank's shard of the student's tensor-parallel group,
    padded as the actor pads its vocabulary), the server asked by the first of them (it serves the
    pooling task at the head's hidden size, its tokenizer is the student's or DIR's)."""
    from megatron_rl_patches.inference.loading.hf.vocab import check_teacher_vocab
    from megatron_rl_patches.teachers.head.teacher_head import TeacherHead
    from megatron_rl_patches.teachers.served.build import served_teacher_of  # lazy: optional dependency httpx
    from megatron_rl_patches.teachers.served.client import ServedTeacher  # lazy: optional dependency httpx

    assert teacher.head is not None  # the builder's route for `;head=DIR`
    head_dir: str = teacher.head
    pairs: list = []

    def build() -> ServedTeacher | None:
        if teacher.tokenizer is None:  # the student's tokenizer: DIR's vocabulary the student's
            check_teacher_vocab(head_dir, student)
        if not host.last:
            return None
        if teacher.tokenizer is not None:  # another tokenizer: the pair read where samples are scored
            pairs.append(cross_pair(args, teacher))
        head = TeacherHead.from_hf(head_dir, tp_group=tp_group(),
                                   make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", None))
        head = dataclasses.replace(head, weight=head.weight.to(head_device()))
        # its context key is its `ServedOpdTeacher`'s (of another tokenizer: sent before its own encoding)
        return served_teacher_of(teacher.without_context(), settings.plan(rollout_temperature(args)), head=head)

    tokenizer = students(args, where)
    if teacher.tokenizer is not None:
        tokenizer = lambda: (pairs[0].tokenizer, f"the tokenizer ';tokenizer={teacher.tokenizer}' names")  # noqa: E731
    named = (lambda: (named_vocab_size(teacher, where),
                      int(student_tokenizer_of(args, where).get_vocab_size(with_added_tokens=True)))) \
        if teacher.same_tokenizer else None
    served = connect_served(build, where, asks=host.asks, job_group=host.job_group, tokenizer=tokenizer,
                            named_vocab=named)
    if served is None:
        return None
    return CrossServed(served, pairs[0], settings.top_k) if pairs else HeadServed(served)


def head_device() -> torch.device:
    """Where the head's shard lives: the rank's GPU (NCCL's collectives), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
