"""`teachers.cross_with_context`: a teacher of another tokenizer's own samples after a privileged
context of its ids — the response's teacher tokens, length and alignment unchanged, the caller's
samples untouched, each refusal named. The buckets on context + response against float64 run in
the slime lane (test_slime_opd_cross_tokenizer_lane.py, its `ctx` world)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("tokenizers")

from megatron_rl_patches import cross_tokenizer as xt  # noqa: E402
from megatron_rl_patches.teachers import cross_with_context  # noqa: E402
from megatron_rl_patches.teachers.head.cross_buckets import cross_batch  # noqa: E402
from tests.cross_tokenizer.conftest import sentencepiece_like  # noqa: E402


@pytest.fixture(scope="module")
def samples():
    student = sentencepiece_like("never")
    pair = xt.cross_teacher(student, sentencepiece_like("first"))
    prompt = student.encode("Q: ", add_special_tokens=False).ids
    out = []
    for text in ("a lazy fox", "the dog"):
        answer = student.encode(text, add_special_tokens=False).ids
        out.append(pair.sample(torch.tensor(prompt + answer), len(answer), torch.ones(len(answer))))
    return out


def test_the_context_replaces_the_teachers_prompt_and_the_response_rows_stay(samples):
    before = [s.tokens.clone() for s in samples]
    contexts = [torch.tensor([7, 8, 9]), torch.tensor([4])]
    got = cross_with_context(samples, contexts)
    for sample, context, one, kept in zip(samples, contexts, got, before):
        response = sample.tokens[-sample.response_length:]
        assert one.tokens.tolist() == context.tolist() + response.tolist()
        assert one.response_length == sample.response_length and one.alignment is sample.alignment
        assert torch.equal(sample.tokens, kept)  # the caller's samples untouched
    batch = cross_batch(got)
    assert batch.response_starts == [3, 1]
    assert [batch.response_rows(i) for i in range(2)] == [s.response_length for s in samples]


def test_refusals_are_named(samples):
    with pytest.raises(ValueError, match=r"1 contexts for a batch of 2 samples"):
        cross_with_context(samples, [torch.tensor([1])])
    with pytest.raises(ValueError, match=r"contexts\[1\] is empty"):
        cross_with_context(samples, [torch.tensor([1]), torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match=r"contexts\[0\] holds id 50, past the teacher's vocabulary of 50"):
        cross_with_context(samples, [torch.tensor([50]), torch.tensor([1])], vocab_size=50)
    with pytest.raises(ValueError, match=r"sample 0's context \(3 ids\).*past max_length=4"):
        cross_with_context(samples, [torch.tensor([1, 2, 3]), torch.tensor([1])], max_length=4)
    with pytest.raises(TypeError, match=r"takes the teacher's TeacherSamples"):
        cross_with_context([torch.tensor([1, 2])], [torch.tensor([1])])


def test_an_in_process_teacher_of_another_tokenizer_in_the_teacher_step_gets_the_same_sequences(samples):
    """The teacher step's route (`send(cross_batch(samples), contexts=...)` to an in-process teacher
    with `context`) hands it `cross_batch(cross_with_context(samples, contexts))`, and its rows come
    back one per teacher response row."""
    from megatron_rl_patches.teachers import TeacherStep, local_host
    from tests.teachers.test_step_contexts import PrefixTeacher

    contexts = [torch.tensor([7, 8, 9]), torch.tensor([4])]
    teacher = PrefixTeacher("hint")
    step = TeacherStep([teacher], local_host(1000))
    step.send(cross_batch(samples), contexts={"hint": contexts})
    (scores,) = step.collect()
    want = cross_batch(cross_with_context(samples, contexts))
    assert [s.tolist() for s in teacher.seen[0].sequences] == [s.tolist() for s in want.sequences]
    assert teacher.seen[0].response_starts == want.response_starts
    assert [len(v) for v in scores.token_log_probs] == [s.response_length for s in samples]
