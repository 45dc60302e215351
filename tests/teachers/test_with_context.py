"""The privileged-context teacher's batch (`teachers.with_context`, `context_ids`, `placed_before`)
against batches built by hand, each refusal named, the caller's tensors untouched, and (hypothesis)
the response rows lined up one to one with the student's for any batch and contexts."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl_patches.teachers import TeacherBatch, context_ids, placed_before, with_context


def student_batch() -> TeacherBatch:
    return TeacherBatch([torch.tensor([5, 6, 7, 8, 9]), torch.tensor([1, 2, 3]), torch.tensor([4, 4])], [2, 3, 1])


def test_sequences_are_context_then_the_students_response():
    batch = student_batch()
    teacher = with_context(batch, [torch.tensor([11, 12, 13]), torch.tensor([20]), torch.tensor([30, 31])])
    assert [s.tolist() for s in teacher.sequences] == [[11, 12, 13, 7, 8, 9], [20], [30, 31, 4]]
    assert teacher.response_starts == [3, 1, 2]
    assert [teacher.response_rows(i) for i in range(3)] == [batch.response_rows(i) for i in range(3)]


def test_dtype_and_device_follow_the_response_and_the_callers_tensors_are_untouched():
    batch = TeacherBatch([torch.tensor([5, 6, 7], dtype=torch.int32)], [1])
    context = torch.tensor([40, 41], dtype=torch.int64)
    kept = [batch.sequences[0].clone(), context.clone()]
    teacher = with_context(batch, [context])
    assert teacher.sequences[0].dtype == torch.int32 and teacher.sequences[0].tolist() == [40, 41, 6, 7]
    teacher.sequences[0][0] = 0
    assert torch.equal(batch.sequences[0], kept[0]) and torch.equal(context, kept[1])
    assert batch.response_starts == [1]


@pytest.mark.parametrize(("contexts", "kind", "words"), [
    ([torch.tensor([1])], ValueError, "1 contexts for a batch of 3 samples"),
    (torch.tensor([[1], [2], [3]]), TypeError, "must be a list of 1-D id tensors, one per sample, got Tensor"),
    (["a hint", "b", "c"], TypeError, "contexts[0] must be a 1-D integer id tensor, got str (text: tokenize"),
    ([torch.tensor([1]), None, torch.tensor([2])], ValueError, "sample 1 has no context (None)"),
    ([torch.tensor([1]), torch.tensor([[2]]), torch.tensor([2])], TypeError, "contexts[1] must be a 1-D integer"),
    ([torch.tensor([1]), torch.tensor([2]), torch.tensor([2.0])], TypeError, "contexts[2] must be a 1-D integer"),
    ([torch.tensor([1]), torch.tensor([True]), torch.tensor([2])], TypeError, "contexts[1] must be a 1-D integer"),
    ([torch.tensor([], dtype=torch.long), torch.tensor([2]), torch.tensor([2])], ValueError, "contexts[0] is empty"),
    ([torch.tensor([1]), torch.tensor([2, -1]), torch.tensor([2])], ValueError, "contexts[1] holds a negative id (-1)"),
])
def test_bad_contexts_named(contexts, kind, words):
    with pytest.raises(kind) as error:
        with_context(student_batch(), contexts)
    assert words in str(error.value)


def test_ids_past_the_teachers_vocabulary_refused_by_sample():
    contexts = [torch.tensor([1]), torch.tensor([2]), torch.tensor([3, 64])]
    assert len(with_context(student_batch(), contexts, vocab_size=65)) == 3
    with pytest.raises(ValueError, match=r"contexts\[2\] holds id 64, past the teacher's vocabulary of 64"):
        with_context(student_batch(), contexts, vocab_size=64)


def test_a_context_past_the_length_budget_refused_before_anything_is_built():
    contexts = [torch.tensor([1, 2, 3]), torch.tensor([2]), torch.tensor([3])]  # sample 0: 3 + 3 response ids
    assert len(with_context(student_batch(), contexts, max_length=6)) == 3
    with pytest.raises(ValueError, match=r"sample 0's context \(3 ids\) and response \(3 ids\) make 6 ids, past "
                                         r"max_length=5"):
        with_context(student_batch(), contexts, max_length=5)


@pytest.mark.parametrize(("keyword", "value"), [("vocab_size", 0), ("max_length", True), ("max_length", 2.5)])
def test_bad_budgets_named(keyword, value):
    with pytest.raises(ValueError, match=rf"with_context\({keyword}={value!r}\): pass"):
        with_context(student_batch(), [torch.tensor([1])] * 3, **{keyword: value})


@pytest.mark.parametrize(("dtype", "context", "vocab_size"), [
    (torch.uint8, [7, 300], 1000),  # would become id 44 silently
    (torch.int16, [40000], None),  # would become id -25536, an id the caller never passed
    (torch.int8, [1, 2, 128], 1000),
    (torch.int32, [2**31], None),
])
def test_an_id_the_responses_dtype_cannot_hold_is_refused_before_any_cast(dtype, context, vocab_size):
    """The teacher's sequence keeps the response's dtype: a context id past that dtype's range is
    refused naming the sample and the id the caller passed, before anything is cast."""
    batch = TeacherBatch([torch.tensor([1, 6, 7], dtype=dtype), torch.tensor([1, 2], dtype=dtype)], [1, 1])
    contexts = [torch.tensor([1]), torch.tensor(context)]
    top = torch.iinfo(dtype).max
    with pytest.raises(ValueError, match=rf"contexts\[1\] holds id {max(context)}, which the response's dtype "
                                         rf"{dtype} cannot hold \(ids up to {top}\)"):
        with_context(batch, contexts, vocab_size=vocab_size)
    with pytest.raises(ValueError, match=rf"privileged\[1\] holds id {max(context)}, which the prompt's dtype "
                                         rf"{dtype} cannot hold"):
        placed_before(batch, contexts, [1])
    fits = [torch.tensor([1]), torch.tensor([top])]
    assert with_context(batch, fits).sequences[1].tolist() == [top, 2]  # the largest id it holds passes
    assert with_context(batch, fits).sequences[1].dtype == dtype
    assert placed_before(batch, fits, [1])[1].tolist() == [top, 1]


def test_batch_must_be_a_teacher_batch():
    with pytest.raises(TypeError, match=r"with_context\(batch=...\) takes the student's TeacherBatch, got list"):
        with_context([torch.tensor([1, 2])], [torch.tensor([1])])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_response_rows_line_up_one_to_one(data):
    samples = data.draw(st.integers(1, 4))
    ids = st.lists(st.integers(0, 99), min_size=1, max_size=8)
    sequences = [data.draw(ids) for _ in range(samples)]
    starts = [data.draw(st.integers(1, len(s))) for s in sequences]
    contexts = [data.draw(ids) for _ in range(samples)]
    batch = TeacherBatch([torch.tensor(s) for s in sequences], starts)
    teacher = with_context(batch, [torch.tensor(c) for c in contexts])
    for i in range(samples):
        assert teacher.sequences[i].tolist() == contexts[i] + sequences[i][starts[i]:]
        assert teacher.response_starts[i] == len(contexts[i])
        assert teacher.response_rows(i) == batch.response_rows(i)


def hinted_tokenizer():
    """A word-level tokenizer whose template adds a BOS (id 0) when special tokens are asked for."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<s>", "solve", "the", "answer", "is", "42", "<|assistant|>", "<|user|>"]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<s>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tokenizer


def test_text_contexts_through_the_teachers_tokenizer(tmp_path):
    tokenizer = hinted_tokenizer()
    assert [c.tolist() for c in context_ids(["the answer is 42", "solve"], tokenizer)] == [[2, 3, 4, 5], [1]]
    assert context_ids(["solve"], tokenizer, add_special_tokens=True)[0].tolist() == [0, 1]
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    for path in (tmp_path, tmp_path / "tokenizer.json"):  # a checkpoint directory or the file, as cross_tokenizer
        assert context_ids(["is 42"], str(path))[0].tolist() == [4, 5]
        assert context_ids(["is 42"], str(path))[0].dtype == torch.int64


@pytest.mark.parametrize(("texts", "kind", "words"), [
    ("the answer", TypeError, "takes a list of strings"),
    (["solve", None], ValueError, "sample 1 has no context (None)"),
    (["solve", ""], ValueError, "texts[1] is empty"),
    ([7], TypeError, "texts[0] must be a str, got int"),
])
def test_bad_text_contexts_named(texts, kind, words):
    with pytest.raises(kind) as error:
        context_ids(texts, hinted_tokenizer())
    assert words in str(error.value)


def test_text_of_no_ids_named():
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, unk_token="a"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    with pytest.raises(ValueError, match=r"texts\[0\] tokenizes to no ids"):
        context_ids(["   "], tokenizer)


USER, ASSISTANT = 7, 6


def chat_batch() -> TeacherBatch:
    # <|user|> solve <|assistant|> | the answer is 42      and      <|user|> the <|assistant|> | 42
    return TeacherBatch([torch.tensor([USER, 1, ASSISTANT, 2, 3, 4, 5]), torch.tensor([USER, 2, ASSISTANT, 5])], [3, 3])


def test_privileged_ids_placed_before_the_assistant_marker():
    batch = chat_batch()
    hints = [torch.tensor([3, 4, 5]), torch.tensor([4, 5])]
    contexts = placed_before(batch, hints, [ASSISTANT])
    assert [c.tolist() for c in contexts] == [[USER, 1, 3, 4, 5, ASSISTANT], [USER, 2, 4, 5, ASSISTANT]]
    teacher = with_context(batch, contexts)
    assert [s.tolist() for s in teacher.sequences] == [[USER, 1, 3, 4, 5, ASSISTANT, 2, 3, 4, 5],
                                                       [USER, 2, 4, 5, ASSISTANT, 5]]
    assert teacher.response_starts == [6, 5]
    for i in range(2):  # the response is the student's, row for row
        assert torch.equal(teacher.sequences[i][teacher.response_starts[i]:],
                           batch.sequences[i][batch.response_starts[i]:])
    assert placed_before(batch, hints, torch.tensor([USER]))[1].tolist() == [4, 5, USER, 2, ASSISTANT]


def test_the_marker_is_searched_in_the_prompt_only():
    # the marker's only occurrence is in the response: the prompt does not hold it
    batch = TeacherBatch([torch.tensor([USER, 1, 2, ASSISTANT])], [2])
    with pytest.raises(ValueError, match=r"sample 0's prompt \(2 ids\) does not hold the marker \[6\]"):
        placed_before(batch, [torch.tensor([3])], [ASSISTANT])


def test_an_ambiguous_marker_refused_unless_an_occurrence_is_named():
    batch = TeacherBatch([torch.tensor([USER, ASSISTANT, 2, USER, ASSISTANT, 3])], [5])  # two turns
    with pytest.raises(ValueError, match=r"sample 0's prompt holds the marker \[6\] 2 times \(at \[1, 4\]\)"):
        placed_before(batch, [torch.tensor([9])], [ASSISTANT])
    assert placed_before(batch, [torch.tensor([9])], [ASSISTANT], occurrence="last")[0].tolist() == \
        [USER, ASSISTANT, 2, USER, 9, ASSISTANT]
    assert placed_before(batch, [torch.tensor([9])], [ASSISTANT], occurrence="first")[0].tolist() == \
        [USER, 9, ASSISTANT, 2, USER, ASSISTANT]


@pytest.mark.parametrize(("marker", "kind", "words"), [
    ([], ValueError, "marker=...) is empty"),
    ("<|assistant|>", TypeError, "must be the marker's ids"),
    (torch.tensor([[6]]), TypeError, "must be a 1-D integer id tensor"),
])
def test_bad_markers_named(marker, kind, words):
    with pytest.raises(kind) as error:
        placed_before(chat_batch(), [torch.tensor([1])] * 2, marker)
    assert words in str(error.value)


def test_placement_checks_the_privileged_ids_and_leaves_the_callers_tensors():
    batch = chat_batch()
    kept = [s.clone() for s in batch.sequences]
    with pytest.raises(ValueError, match=r"sample 1 has no context \(None\)"):
        placed_before(batch, [torch.tensor([1]), None], [ASSISTANT])
    with pytest.raises(ValueError, match="occurrence='middle'"):
        placed_before(batch, [torch.tensor([1])] * 2, [ASSISTANT], occurrence="middle")
    contexts = placed_before(batch, [torch.tensor([1])] * 2, [ASSISTANT])
    contexts[0][0] = 99
    assert all(torch.equal(a, b) for a, b in zip(batch.sequences, kept))
