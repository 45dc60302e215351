"""The served kind's framework-free builder (`build_served`): a `ServedTeacher` from its entry
(`URL;engine=vllm`, `;head=DIR` for hidden states through the teacher's head, cut and padded for the
host's student: `host_head`), connected on the
host's asking rank (the first rank of its sharing group): the server answers, K within its limit,
its tokenizer the student's (probed with the student's tokenizer, or the entry's
`;same_tokenizer;vocab=N` for a server without one; with `;head=DIR` too, N must be the head's
vocabulary). A failure anywhere is the same ValueError
naming the entry on every rank of the host's job. An entry with another tokenizer
(`;tokenizer=DIR`) scores its own encoding in chunk-start buckets, which the teacher step's
per-row scores do not carry: refused by name."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.ops.scoring_plan import ScoringPlan
from megatron_rl_patches.teachers.agreement import agree_failure
from megatron_rl_patches.teachers.entry import TeacherEntry
from megatron_rl_patches.teachers.head.for_host import head_for_host
from megatron_rl_patches.teachers.host import asks
from megatron_rl_patches.teachers.named_vocab import check_head_vocab, named_vocab_size
from megatron_rl_patches.teachers.redaction import redacted
from megatron_rl_patches.teachers.served.connect import connect_served


def served_teacher_of(entry: TeacherEntry, plan: ScoringPlan, *, client: Any = None, head: Any = None,
                      model: str | None = None) -> Any:
    """The `ServedTeacher` an entry names (its URLs, engine and context key) scoring at `plan` (the
    door's `ScoringPlan`): the one construction from an entry, which every framework's builder goes
    through. `head`: the entry's `;head=DIR` as
    the caller holds it (a `TeacherHead` cut for its layout); None reads that directory whole here.
    A caller that puts the context in the sequences it sends itself passes the entry without it."""
    from megatron_rl_patches.teachers.served.client import ServedTeacher  # lazy: import cost: httpx, torch

    return ServedTeacher(entry.path, "vllm" if entry.engine is None else entry.engine, plan=plan, client=client,
                         head=entry.head if head is None else head, model=model, context=entry.context)


def checked_tokenizer(entry: TeacherEntry, options: Any, where: str) -> Any:
    """The student's tokenizer the served model is probed against (None for `;same_tokenizer`);
    ValueError naming the entry for one this step cannot serve."""
    if entry.tokenizer is not None:
        raise ValueError(f"{where} has ';tokenizer={entry.tokenizer}' (another tokenizer than the student's): its "
                         "chunk-start buckets are slime's top-k OPD's (MEGATRON_RL_PATCHES_OPD_TEACHERS); the teacher "
                         "step scores the student's ids: serve a teacher of the student's tokenizer, or give it "
                         "';head=DIR' and use teachers.head_buckets")
    if options.student_tokenizer is None and not entry.same_tokenizer:
        raise ValueError(f"{where}: its tokenizer is checked against the student's: pass "
                         "build_teachers(student_tokenizer=...) (a tokenizers.Tokenizer, a tokenizer.json or a "
                         "directory holding one), or write ';same_tokenizer;vocab=N' for a server without one")
    if entry.same_tokenizer:
        return None
    from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer  # lazy: optional dependency tokenizers

    return load_tokenizer(options.student_tokenizer, "build_teachers(student_tokenizer=...)")


def build_served(entry: TeacherEntry, host: Any, options: Any) -> Any:
    """The entry's `ServedTeacher`, connected (see the module's words)."""
    from megatron_rl_patches.teachers.served.client import ServedTeacher  # lazy: import cost: httpx, torch

    where = f"build_teachers: entry {redacted(entry.path)!r}"
    tokenizer = None
    student: Any = None
    error: Exception | None = None
    try:  # checked on every rank, agreed before the connection's collective
        student = checked_tokenizer(entry, options, where)
    except Exception as failed:  # noqa: BLE001 - agreed over the job just below
        error = failed
    agree_failure(error, host.job_group, own=True)
    if student is not None:

        def tokenizer() -> tuple[Any, str]:
            return student, "the student's"

    def named_vocab() -> tuple[int, int]:
        return named_vocab_size(entry, where), int(host.vocab_size)

    def build() -> ServedTeacher:
        named = named_vocab_size(entry, where) if entry.same_tokenizer and entry.head is not None else None
        head = None if entry.head is None else head_for_host(entry.head, host, where)
        teacher = served_teacher_of(entry, options.plan, client=options.client, head=head)
        if named is not None and teacher.head is not None:
            try:
                check_head_vocab(named, teacher.head.vocab_size, entry.head, where)
            except ValueError:
                teacher.close()
                raise
        return teacher

    teacher = connect_served(build, where, asks=asks(host), job_group=host.job_group, tokenizer=tokenizer,
                             named_vocab=named_vocab if entry.same_tokenizer else None)
    assert teacher is not None  # every rank builds it
    return teacher
