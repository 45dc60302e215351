"""The privileged-context helpers' (`teachers.context.teacher_context`) refusals matched whole, and
`checked_contexts` (the contexts checked as `with_context` checks them, nothing built): the
words `test_with_context.py` matches in part, each here in full, so a changed word or a lost
type name fails."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from megatron_rl_patches.teachers import TeacherBatch, context_ids, placed_before
from megatron_rl_patches.teachers.context.teacher_context import checked_contexts, with_context

USER, ASSISTANT = 7, 6


def student_batch() -> TeacherBatch:
    return TeacherBatch([torch.tensor([5, 6, 7, 8, 9]), torch.tensor([1, 2, 3]), torch.tensor([4, 4])], [2, 3, 1])


def chat_batch() -> TeacherBatch:
    return TeacherBatch([torch.tensor([USER, 1, ASSISTANT, 2, 3]), torch.tensor([USER, 2, ASSISTANT, 5])], [3, 3])


def word_tokenizer(words: dict[str, int]):
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token=next(iter(words))))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return tokenizer


def words(kind: type[Exception], function: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """What `function(*args, **kwargs)` raises, of `kind`."""
    with pytest.raises(kind) as raised:
        function(*args, **kwargs)
    return str(raised.value)


def test_checked_contexts_are_the_callers_own_checked_as_with_context_checks_them():
    batch = student_batch()
    contexts = [torch.tensor([1]), torch.tensor([2, 3]), torch.tensor([63])]
    checked = checked_contexts(batch, contexts, vocab_size=64)
    assert checked == contexts and all(a is b for a, b in zip(checked, contexts))
    assert len(batch.sequences[0]) == 5  # nothing built
    assert words(ValueError, checked_contexts, batch, contexts, vocab_size=63) == (
        "with_context(contexts=...): contexts[2] holds id 63, past the teacher's vocabulary of 63: tokenize the "
        "context with the teacher's tokenizer")
    assert words(ValueError, checked_contexts, batch, contexts, vocab_size=0) == (
        "with_context(vocab_size=0): pass the teacher's vocabulary size, a positive int, or None")
    assert words(ValueError, checked_contexts, batch, contexts[:2]) == (
        "with_context(contexts=...) holds 2 contexts for a batch of 3 samples: give one per sample, in the "
        "batch's order")
    assert words(TypeError, checked_contexts, batch, [torch.tensor([1]), torch.tensor([[2]]), torch.tensor([3])]) == (
        "with_context(contexts=...): contexts[1] must be a 1-D integer id tensor, got a tensor of shape (1, 1) and "
        "dtype torch.int64 (text: tokenize it with context_ids)")
    assert words(TypeError, checked_contexts, [torch.tensor([1])], contexts) == (
        "with_context(batch=...) takes the student's TeacherBatch, got list")


def test_an_id_the_sequences_dtype_cannot_hold_is_refused_whole():
    batch = TeacherBatch([torch.tensor([5, 6, 7], dtype=torch.int16)], [1])
    assert words(ValueError, with_context, batch, [torch.tensor([40000])]) == (
        "contexts[0] holds id 40000, which the response's dtype torch.int16 cannot hold (ids up to 32767): the "
        "teacher's sequence keeps the response's dtype; give the student's sequences as int64 (or a dtype holding "
        "the teacher's vocabulary)")


def test_context_ids_refusals_are_whole():
    assert words(TypeError, context_ids, "the answer", word_tokenizer({"a": 0})) == (
        "context_ids(texts=...) takes a list of strings, one per sample, got str")
    assert words(ValueError, context_ids, ["   "], word_tokenizer({"a": 0})) == (
        "context_ids(texts=...): texts[0] tokenizes to no ids: give that sample a context the teacher's tokenizer "
        "reads")


def test_context_ids_names_its_tokenizer_argument(tmp_path):
    missing = tmp_path / "nowhere"
    assert words(ValueError, context_ids, ["solve"], missing) == (
        f"context_ids(tokenizer=...): no tokenizer.json at {str(missing)!r}; pass a tokenizer.json file or a "
        "checkpoint directory holding one (a checkpoint with only a SentencePiece/tiktoken file: convert it with "
        "transformers and save tokenizer.json)")
    assert words(TypeError, context_ids, ["solve"], 7).startswith(
        "context_ids(tokenizer=...) must be a tokenizers.Tokenizer, ")


def test_placed_before_refusals_are_whole():
    hints = [torch.tensor([1])] * 2
    assert words(TypeError, placed_before, [torch.tensor([1])], hints, [ASSISTANT]) == (
        "placed_before(batch=...) takes the student's TeacherBatch, got list")
    assert words(ValueError, placed_before, chat_batch(), hints, []) == (
        "placed_before(marker=...) is empty: give the ids of the prompt's marker (e.g. the assistant turn's)")
    for marker in ([ASSISTANT, "x"], [1.5], (True,)):
        assert words(TypeError, placed_before, chat_batch(), hints, marker) == (
            f"placed_before(marker=...) must be the marker's ids (a 1-D integer tensor or a list of ints), got "
            f"{type(marker).__name__} (text: tokenize it with context_ids([text], tokenizer)[0])")
    assert words(ValueError, placed_before, chat_batch(), hints, [9]) == (
        "placed_before: sample 0's prompt (3 ids) does not hold the marker [9]: name a token sequence the student's "
        "prompt holds, or use the privileged ids as the whole teacher prompt (with_context(batch, privileged))")
