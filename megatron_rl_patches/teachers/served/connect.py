"""A served teacher connected for a training job (`connect_served`), framework-free: built on the
ranks that hold it, asked by the one that will ask it (the server answers, K within its limit,
its tokenizer is the one expected, or the vocabulary the entry names covers the student's ids),
and a failure on any rank raised on every rank of the job as a ValueError naming the entry."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_rl_patches.teachers.agreement import agree_failure
from megatron_rl_patches.teachers.named_vocab import check_named_vocab
from megatron_rl_patches.teachers.served.engines.names import in_entry_words
from megatron_rl_patches.teachers.served.tokenizer_probe import probe_tokenizer

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.teachers.served.client import ServedTeacher

# () -> (the tokenizer the served model must share, whose it is: for the refusal's words)
ExpectedTokenizer = Callable[[], tuple[Any, str]]
# () -> (the served vocabulary the entry names, the number of ids the student's tokenizer writes)
NamedVocab = Callable[[], tuple[int, int]]


def connect_served(build: Callable[[], ServedTeacher | None], where: str, *, asks: bool, job_group: Any,
                   tokenizer: ExpectedTokenizer | None = None, named_vocab: NamedVocab | None = None
                   ) -> ServedTeacher | None:
    """`build()` (None on a rank that holds no served teacher) checked on the rank that `asks`:
    `check()`, then `named_vocab` (the user's word, a server without a tokenizer: nothing sent)
    or the probe of `tokenizer` (the model's `/tokenize`). Every rank of `job_group` calls it; a
    failure anywhere is a ValueError naming `where` on every rank."""
    error: BaseException | None = None
    teacher = None
    try:
        teacher = build()
        if asks and teacher is not None:
            teacher.check()
            if named_vocab is not None:
                size, student_ids = named_vocab()
                check_named_vocab(size, student_ids, where)
            elif tokenizer is not None:
                expected, whose = tokenizer()
                probe_tokenizer(teacher, expected, where, whose)
    except Exception as failed:  # noqa: BLE001 - agreed over the job, then raised
        error = failed
    agree_at_load(error, where, job_group)
    return teacher


def agree_at_load(error: BaseException | None, where: str, job_group: Any) -> None:
    """A failure of a served teacher's load on any rank (`error` here) raised on every rank of
    `job_group` as a ValueError naming the entry (`where`)."""
    try:
        agree_failure(error, job_group)
    except Exception as agreed:
        raise ValueError(f"{where}: {in_entry_words(str(agreed))}") from agreed
