"""A served teacher whose tokenizer cannot be probed (vLLM's `--skip-tokenizer-init`) and that the
user says shares the student's (`;same_tokenizer`): its vocabulary size as the entry names it
(`;vocab=N`, or the `vocab_size` of `;config=PATH`), checked against the ids the student's
tokenizer can write, never by sending ids (an id past its vocabulary stops such an engine).
Standard library only."""
from __future__ import annotations

from pathlib import Path

from megatron_rl_patches.inference.loading.json_read import json_file

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.teachers.entry import TeacherEntry


def named_vocab_size(entry: TeacherEntry, where: str) -> int:
    """The served model's vocabulary size the entry names; ValueError naming the option."""
    if entry.vocab is not None:
        return entry.vocab
    if entry.config is None:
        raise ValueError(f"{where}: ';same_tokenizer' needs ';vocab=N' or ';config=PATH'")
    path = Path(entry.config).expanduser()
    file = path / "config.json" if path.is_dir() else path
    config = json_file(file, lambda problem: ValueError(
        f"{where}: ';config={entry.config}' is no readable config.json ({str(file)!r} {problem}); name the served "
        "model's config.json or its directory, or give ';vocab=N'"))
    nested = config.get("text_config") if isinstance(config, dict) else None
    size = config.get("vocab_size") if isinstance(config, dict) else None
    if size is None and isinstance(nested, dict):
        size = nested.get("vocab_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{where}: {str(file)!r} gives no vocab_size (a positive int); give ';vocab=N'")
    return size


def check_named_vocab(size: int, student_ids: int, where: str) -> None:
    """Every id the student's tokenizer writes (< `student_ids`) inside the served vocabulary."""
    if student_ids > size:
        raise ValueError(f"{where}: the student's tokenizer writes ids up to {student_ids - 1}, past the served "
                         f"model's vocabulary of {size} the entry names: its tokenizer is not the student's (or the "
                         "size named is wrong); serve a teacher of the student's tokenizer, or correct ';vocab=' / "
                         "';config='")


def check_head_vocab(named: int, head: int, directory: str | None, where: str) -> None:
    """The vocabulary `;same_tokenizer` names equals the `;head=DIR` head's (one served model)."""
    if named != head:
        raise ValueError(f"{where}: ';same_tokenizer' names a served vocabulary of {named}, but the head of "
                         f"';head={directory}' has {head} rows (its config.json's vocab_size): the head and the "
                         "served model must be one model; correct ';vocab=' / ';config=' or the head's directory")
