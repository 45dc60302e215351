"""`SelfTeacher` on logits given by hand, in one process (fast, beside test_self_teacher.py's real
GPTModel): its scores the float64 log-softmax of the pass's rows at the step's temperature (the
output layer's padding cut), a pass run without autograd, a batch without rows, and each refusal
matched whole."""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron_rl_patches.teachers import LoopHost, SelfTeacher, TeacherBatch
from megatron_rl_patches.teachers.self_teacher import self_teacher

V, PADDED, K = 12, 16, 3


def words(kind: type[Exception], function: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """What `function(*args, **kwargs)` raises, of `kind`."""
    with pytest.raises(kind) as raised:
        function(*args, **kwargs)
    return str(raised.value)


def batch_and_logits() -> tuple[TeacherBatch, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    batch = TeacherBatch([torch.randint(0, V, (7,), generator=gen), torch.randint(0, V, (4,), generator=gen)], [3, 2])
    logits = [torch.randn(batch.response_rows(i), PADDED, generator=gen) * 3 for i in range(len(batch))]
    return batch, logits


def test_scores_are_the_float64_log_softmax_of_the_pass_at_the_temperature():
    batch, logits = batch_and_logits()
    grads: list[bool] = []

    def student_pass(given: TeacherBatch) -> list[torch.Tensor]:
        assert given is batch
        grads.append(torch.is_grad_enabled())
        return [one.clone().requires_grad_() for one in logits]

    teacher = SelfTeacher(student_pass, V, K, context="hint", temperature=0.7)
    scores = teacher.score(batch)
    assert grads == [False] and repr(teacher) == "SelfTeacher(context='hint', top_k=3)"
    for i, one in enumerate(logits):
        want = torch.log_softmax(one[:, :V].double() / 0.7, dim=-1)  # the padding past V cut
        ids = want.topk(K, dim=-1).indices
        tokens = batch.sequences[i][batch.response_starts[i]:]
        assert torch.equal(scores.topk_ids[i], ids)
        for got, expected in ((scores.topk_log_probs[i], want.gather(1, ids)),
                              (scores.token_log_probs[i], want.gather(1, tokens[:, None])[:, 0]),
                              (scores.tail_log_probs[i], want.scatter(1, ids, -torch.inf).logsumexp(-1))):
            assert got.dtype == torch.float64 and not got.requires_grad
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_a_batch_without_response_rows_scores_empty_rows():
    batch = TeacherBatch([torch.tensor([1, 2]), torch.tensor([3])], [2, 1])
    scores = SelfTeacher(lambda b: [torch.zeros(0, V), torch.zeros(0, V)], V, K, context="hint").score(batch)
    for part, shape, dtype in ((scores.token_log_probs, (0,), torch.float64), (scores.topk_ids, (0, K), torch.int64),
                               (scores.topk_log_probs, (0, K), torch.float64),
                               (scores.tail_log_probs, (0,), torch.float64)):
        assert [(tuple(one.shape), one.dtype) for one in part] == [(shape, dtype)] * 2


def test_a_pass_of_another_shape_or_width_is_refused_whole():
    batch, logits = batch_and_logits()
    teacher = SelfTeacher(lambda b: [logits[0], logits[1][:, :V + 1]], V, K, context="hint")
    assert words(ValueError, teacher.score, batch) == (
        "SelfTeacher: the host's student_pass returned logits of widths [13, 16]: every sample's rows come from one "
        "output layer (one width)")
    narrow = SelfTeacher(lambda b: [logits[0], logits[1][:, :V - 1]], V, K, context="hint")
    assert words(ValueError, narrow.score, batch) == (
        "SelfTeacher: the host's student_pass returned (2, 11) for sample 1: expected its 2 response rows of logits "
        "over the student's 12 ids [2, V >= 12]")
    flat = SelfTeacher(lambda b: [logits[0][0], logits[1]], V, K, context="hint")
    assert words(ValueError, flat.score, batch) == (
        "SelfTeacher: the host's student_pass returned (16,) for sample 0: expected its 4 response rows of logits "
        "over the student's 12 ids [4, V >= 12]")
    listed = SelfTeacher(lambda b: [logits[0].tolist(), logits[1]], V, K, context="hint")
    assert words(ValueError, listed.score, batch) == (
        "SelfTeacher: the host's student_pass returned list for sample 0: expected its 4 response rows of logits "
        "over the student's 12 ids [4, V >= 12]")
    assert words(ValueError, SelfTeacher(lambda b: logits[:1], V, K, context="hint").score, batch) == (
        "SelfTeacher: the host's student_pass returned 1 logit tensors for a batch of 2 samples: return one [R_i, V] "
        "tensor per sample")
    assert words(TypeError, teacher.score, [batch]) == "SelfTeacher.score(batch) takes a TeacherBatch, got list"


def test_bad_arguments_are_refused_whole():
    def student_pass(batch):
        return []

    assert words(TypeError, SelfTeacher, 3, V, K, context="hint") == (
        "SelfTeacher(student_pass=...) must be the host's pass of the student's model, a callable (TeacherBatch) -> "
        "per-sample logits [R_i, V], got int")
    assert words(ValueError, SelfTeacher, student_pass, V, V + 1, context="hint") == (
        "SelfTeacher(top_k=13) is over the student's vocabulary of 12")
    for bad in (0, -1.0, True, "1", float("nan")):
        assert words(ValueError, SelfTeacher, student_pass, V, K, context="hint", temperature=bad) == (
            f"SelfTeacher(temperature={bad!r}): pass a positive float")
    assert SelfTeacher(student_pass, V, V, context="hint", temperature=2).temperature == 2.0
    assert words(ValueError, SelfTeacher, student_pass, 0, K, context="hint") == (
        "SelfTeacher(vocab_size=...) must be a positive int (the student's real vocabulary), got 0")


def test_the_hosts_self_teacher_takes_its_pass_and_layout_or_is_refused_naming_where():
    def student_pass(batch):
        return []

    host = LoopHost(V, student_pass=student_pass)
    teacher = self_teacher(host, K, 0.5, "hint", "entry 'student;context=hint'")
    assert (teacher.student_pass, teacher.vocab_size, teacher.top_k, teacher.temperature, teacher.context,
            teacher.tp_group, teacher.padded_vocab_size) == (student_pass, V, K, 0.5, "hint", None, None)
    group = object()  # the host's tensor-parallel group, handed on as it is (read only with a world)
    laid_out = SimpleNamespace(student_pass=student_pass, vocab_size=V, tp_group=group, padded_vocab_size=PADDED)
    teacher = self_teacher(laid_out, K, 1.0, "hint", "entry 'student;context=hint'")
    assert (teacher.tp_group, teacher.padded_vocab_size) == (group, PADDED)
    assert words(ValueError, self_teacher, LoopHost(V), K, 1.0, "hint", "entry 'student;context=hint'") == (
        "entry 'student;context=hint': the live self-teacher scores through the host's own pass of the student's "
        "model: give the host one (LoopHost(vocab_size, ..., student_pass=fn): fn(batch) -> per-sample logits "
        "[R_i, V] of the student's current weights on the batch's response rows)")
