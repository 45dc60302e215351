"""Teachers from entries, framework-free (`build_teachers`): each entry of the teacher grammar
(MEGATRON_RL_PATCHES_OPD_TEACHERS's: a URL, a checkpoint path, a provider) parsed by the kinds
table and built through its kind (`TeacherKind.build(entry, host, options)`). A served entry is
built here (`served_build`: connected on the host's asking rank, a failure the same error on every
rank of its job); an in-process kind needs a framework to load a model, so the host builds it
(`host.build_teacher(entry, options)`, where the host gives one; with `;context=KEY` wrapped in
`Privileged(teacher, KEY)`) or the entry is refused by name.
Every teacher is built at one `ScoringPlan` (the caller's `plan`, or `top_k` and `temperature`
made into one): the teachers come back in the entries' order, ready for `TeacherStep(teachers,
host, plan)`."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.ops.scoring_plan import Planned, ScoringPlan, scoring_plan
from megatron_rl_patches.teachers.agreement import agreed_views
from megatron_rl_patches.teachers.context.privileged import Privileged
from megatron_rl_patches.teachers.entry import TeacherEntry
from megatron_rl_patches.teachers.kinds import kind_named, read_entry
from megatron_rl_patches.teachers.redaction import refuse_userinfo

ENTRIES = "build_teachers(entries=...)"


@dataclass(frozen=True)
class BuildOptions(Planned):
    """What every teacher of one step is built with: `plan` (the step's `ScoringPlan`: K,
    temperature), `student_tokenizer` (a `tokenizers.Tokenizer`, a tokenizer.json or a directory
    holding one: a served model's tokenizer is checked against it; None: the entry must say
    `;same_tokenizer`), `client` (a `ClientSettings` for served teachers; None: the defaults)."""

    plan: ScoringPlan
    student_tokenizer: Any = None
    client: Any = None


def entries_of(entries: str | Sequence[str | TeacherEntry]) -> list[TeacherEntry]:
    """A comma-separated string, or a list of entry strings / parsed entries, as parsed entries; a
    user or password in a URL refused once where it comes in, before anything splits the string or
    an entry (a hand-made `TeacherEntry` is checked by the client it builds)."""
    if isinstance(entries, str):
        refuse_userinfo(entries, ENTRIES)
        pieces: list[str | TeacherEntry] = [piece for piece in entries.split(",") if piece.strip()]
    elif isinstance(entries, Sequence) and not isinstance(entries, bytes):
        pieces = list(entries)
        for piece in pieces:
            if isinstance(piece, str):
                refuse_userinfo(piece, ENTRIES)
    else:
        raise TypeError(f"build_teachers(entries=...) takes a comma-separated str or a list of entries, got "
                        f"{type(entries).__name__}")
    if not pieces:
        raise ValueError("build_teachers(entries=...) names no teacher: give at least one entry, e.g. "
                         "'http://host:8000;engine=vllm'")
    parsed = []
    for piece in pieces:
        if isinstance(piece, TeacherEntry):
            parsed.append(piece)
        elif isinstance(piece, str):
            parsed.append(read_entry(piece))
        else:
            raise TypeError(f"build_teachers(entries=...): an entry is a str or a TeacherEntry, got "
                            f"{type(piece).__name__}")
    return parsed


def build_teachers(entries: str | Sequence[str | TeacherEntry], host: Any, *, top_k: int | None = None,
                   temperature: float | None = None, student_tokenizer: Any = None, client: Any = None,
                   plan: ScoringPlan | None = None) -> list[Any]:
    """Every entry's teacher built through its kind, in order; every rank of the host's job calls
    it alike. Everything is checked before anything is built (the entries parsed, the options,
    each in-process entry's host builder), so a bad entry leaves nothing open; the checks and the
    entries' kinds are agreed over the host's job group, so one rank's bad argument is the same
    error on every rank, never a rank left waiting in another's connection."""
    group = getattr(host, "job_group", None)
    error: Exception | None = None
    view = None
    try:
        options = BuildOptions(scoring_plan(plan, top_k, temperature, "build_teachers"), student_tokenizer, client)
        parsed, kinds = checked(entries, host, options)
        view = [kind.name for kind in kinds]
    except Exception as failed:  # noqa: BLE001 - agreed over the job: the same error on every rank
        error = failed
    views = agreed_views(error, group, view, own=True)
    if len({repr(seen) for seen in views}) > 1:  # each entry's build makes collectives: the same on every rank
        raise ValueError(f"build_teachers: the ranks name different teachers ({', '.join(map(str, views))}, by rank): "
                         "pass the same entries, in the same order, on every rank of the job")
    built: list[Any] = []
    try:
        for entry, kind in zip(parsed, kinds):
            build = kind.build if kind.build is not None else host_build
            built.append(build(entry, host, options))
    except BaseException:
        for teacher in built:  # the ones already connected: their clients closed
            close = getattr(teacher, "close", None)
            if callable(close):
                close()
        raise
    return built


def checked(entries: str | Sequence[str | TeacherEntry], host: Any,
            options: BuildOptions) -> tuple[list[TeacherEntry], list[Any]]:
    """The parsed entries and their kinds, each checked (everything before anything is built)."""
    parsed = entries_of(entries)
    for name in ("share_group", "job_group", "vocab_size"):
        if not hasattr(host, name):
            raise TypeError(f"build_teachers(host=...) has no {name}: pass a TeacherHost (e.g. "
                            f"megatron_host(parallel_state, vocab_size) or local_host(vocab_size))")
    kinds = [kind_named(entry.kind) for entry in parsed]
    for entry, kind in zip(parsed, kinds):
        if kind.build is None and not callable(getattr(host, "build_teacher", None)):
            raise ValueError(f"build_teachers: entry {entry.path!r} is a {kind.name} teacher, which a framework "
                             f"loads in process: this host builds none (give it build_teacher(entry, options), "
                             f"or build the model yourself and pass it to TeacherStep as a BatchTeacher)")
    return parsed, kinds


def host_build(entry: TeacherEntry, host: Any, options: BuildOptions) -> Any:
    """An in-process kind's teacher: the host's, given the entry's `;context=KEY` by the one
    wrapper (`Privileged(teacher, KEY)`): the host's teacher itself is never changed."""
    teacher = host.build_teacher(entry, options)
    return teacher if entry.context is None else Privileged(teacher, entry.context)
