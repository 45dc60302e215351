"""`SelfTeacher` on hidden states and an output weight given by hand, in one process (fast, beside
test_self_teacher.py's real GPTModel): its scores the float64 log-softmax of the rows' logits
(hidden @ weight.T) at the step's temperature (the output layer's padding cut), a pass run without
autograd, a batch without rows, and each refusal matched whole."""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron_rl_patches.ops.scoring_plan import shown
from megatron_rl_patches.teachers import LoopHost, ScoringPlan, SelfTeacher, StudentHidden, TeacherBatch
from megatron_rl_patches.teachers.self_teacher import self_teacher

V, PADDED, K, H = 12, 16, 3, 5


def words(kind: type[Exception], function: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """What `function(*args, **kwargs)` raises, of `kind`."""
    with pytest.raises(kind) as raised:
        function(*args, **kwargs)
    return str(raised.value)


def batch_and_hidden() -> tuple[TeacherBatch, StudentHidden]:
    gen = torch.Generator().manual_seed(3)
    batch = TeacherBatch([torch.randint(0, V, (7,), generator=gen), torch.randint(0, V, (4,), generator=gen)], [3, 2])
    hidden = [torch.randn(batch.response_rows(i), H, generator=gen, dtype=torch.float64) for i in range(len(batch))]
    return batch, StudentHidden(hidden, torch.randn(PADDED, H, generator=gen, dtype=torch.float64) * 2)


def test_scores_are_the_float64_log_softmax_of_the_pass_at_the_temperature():
    batch, given = batch_and_hidden()
    grads: list[bool] = []

    def student_pass(asked: TeacherBatch) -> StudentHidden:
        assert asked is batch
        grads.append(torch.is_grad_enabled())
        return StudentHidden([one.clone().requires_grad_() for one in given.hidden],
                             given.output_weight.clone().requires_grad_())

    teacher = SelfTeacher(student_pass, V, K, context="hint", temperature=0.7)
    scores = teacher.score(batch)
    assert grads == [False] and repr(teacher) == "SelfTeacher(context='hint', top_k=3)"
    tokens = torch.cat([s[start:] for s, start in zip(batch.sequences, batch.response_starts)])
    among = (torch.cat(scores.topk_ids) == tokens[:, None]).any(1)
    assert among.any() and not among.all()  # the token among the top-k on some rows, outside it on others
    for i, one in enumerate(given.hidden):
        want = torch.log_softmax((one @ given.output_weight.T)[:, :V] / 0.7, dim=-1)  # the padding past V cut
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
    empty = StudentHidden([torch.zeros(0, H), torch.zeros(0, H)], torch.zeros(V, H))
    scores = SelfTeacher(lambda b: empty, V, K, context="hint").score(batch)
    for part, shape, dtype in ((scores.token_log_probs, (0,), torch.float64), (scores.topk_ids, (0, K), torch.int64),
                               (scores.topk_log_probs, (0, K), torch.float64),
                               (scores.tail_log_probs, (0,), torch.float64)):
        assert [(tuple(one.shape), one.dtype) for one in part] == [(shape, dtype)] * 2


def test_a_pass_of_another_shape_or_width_is_refused_whole():
    batch, given = batch_and_hidden()
    hidden, weight = given.hidden, given.output_weight

    def refusal(*returned: Any) -> str:
        return words(ValueError, SelfTeacher(lambda b: returned[0] if len(returned) == 1 else StudentHidden(*returned),
                                             V, K, context="hint").score, batch)

    assert refusal([hidden[0] @ weight.T, hidden[1] @ weight.T]) == (
        "SelfTeacher: the host's student_pass returned list: return StudentHidden(hidden=[R_i, H] per sample, "
        "output_weight=[V, H]) (the student's final hidden states and output layer's weight, never logits)")
    assert refusal(hidden, weight[:V - 1]) == (
        "SelfTeacher: the host's student_pass returned an output_weight of (11, 5): expected the student's output "
        "layer over its 12 ids [V >= 12, H]")
    assert refusal(hidden, weight[0]) == (
        "SelfTeacher: the host's student_pass returned an output_weight of (5,): expected the student's output "
        "layer over its 12 ids [V >= 12, H]")
    assert refusal([hidden[0], hidden[1][:, :H - 1]], weight) == (
        "SelfTeacher: the host's student_pass returned hidden states (2, 4) torch.float64 for sample 1: expected its "
        "2 response rows [2, 5] in the output weight's dtype torch.float64 (whole rows: sequence parallelism gathered)")
    assert refusal([hidden[0][0], hidden[1]], weight) == (
        "SelfTeacher: the host's student_pass returned hidden states (5,) torch.float64 for sample 0: expected its "
        "4 response rows [4, 5] in the output weight's dtype torch.float64 (whole rows: sequence parallelism gathered)")
    assert refusal([hidden[0].float(), hidden[1]], weight) == (
        "SelfTeacher: the host's student_pass returned hidden states (4, 5) torch.float32 for sample 0: expected its "
        "4 response rows [4, 5] in the output weight's dtype torch.float64 (whole rows: sequence parallelism gathered)")
    assert refusal([hidden[0].tolist(), hidden[1]], weight) == (
        "SelfTeacher: the host's student_pass returned hidden states list for sample 0: expected its 4 response rows "
        "[4, 5] in the output weight's dtype torch.float64 (whole rows: sequence parallelism gathered)")
    assert refusal(hidden[:1], weight) == (
        "SelfTeacher: the host's student_pass returned 1 hidden-state tensors for a batch of 2 samples: return one "
        "[R_i, H] tensor per sample")
    teacher = SelfTeacher(lambda b: given, V, K, context="hint")
    assert words(TypeError, teacher.score, [batch]) == "SelfTeacher.score(batch) takes a TeacherBatch, got list"


def test_bad_arguments_are_refused_whole():
    def student_pass(batch):
        return []

    assert words(TypeError, SelfTeacher, 3, V, K, context="hint") == (
        "SelfTeacher(student_pass=...) must be the host's pass of the student's model, a callable (TeacherBatch) -> "
        "StudentHidden(hidden=[R_i, H] per sample, output_weight=[V, H]), got int")
    for k in (V, V + 1):  # issue 105 item 7: refused here, not at the first score
        assert words(ValueError, SelfTeacher, student_pass, V, k, context="hint") == (
            f"SelfTeacher(top_k={k}) must be below the student's vocabulary of 12: the tail (every id outside the "
            f"top-k) holds at least one")
    for bad in (0, -1.0, True, "1", float("nan"), float("inf"), 10**400, 1e-320):
        assert words(ValueError, SelfTeacher, student_pass, V, K, context="hint", temperature=bad) == (
            f"SelfTeacher(temperature=...) must be a finite number > 0 (its reciprocal finite), got {shown(bad)[:60]}")
    assert SelfTeacher(student_pass, V, V - 1, context="hint", temperature=2).temperature == 2.0
    assert words(ValueError, SelfTeacher, student_pass, 0, K, context="hint") == (
        "SelfTeacher(vocab_size=...) must be a positive int (the student's real vocabulary), got 0")
    assert words(ValueError, SelfTeacher, student_pass, 10**400, K, context="hint") == (
        "SelfTeacher(vocab_size=1000000000000000000000000000000000000000…) is past any vocabulary: a token id is an "
        "int64 (at most 2**63 - 1)")
    for padded in (V - 1, 0, True, "16"):
        assert words(ValueError, SelfTeacher, student_pass, V, K, context="hint", padded_vocab_size=padded) == (
            f"SelfTeacher(padded_vocab_size={padded!r}): the rows of the student's output layer over its "
            f"tensor-parallel group, an int >= vocab_size (12), or None")


def test_the_constructions_edges_and_words():
    """Issue 105 item 10 (the mutation run): each refusal whole, each bound at its edge."""
    def student_pass(batch):
        return []

    assert words(ValueError, SelfTeacher, student_pass, V, K, context=None) == (
        "SelfTeacher(context=None): the live self-teacher without a privileged context would be the student scoring "
        "itself (every divergence zero); give it the key of each sample's context, e.g. 'student;context=solution'")
    assert words(ValueError, SelfTeacher, student_pass, V, K, context=3).startswith("SelfTeacher(context=...): ")
    assert words(ValueError, SelfTeacher, student_pass, V, 0, context="hint") == (
        "SelfTeacher(top_k=...) must be a positive int (the teacher's buckets per row), got 0")
    assert SelfTeacher(student_pass, 2**63, K, context="hint").vocab_size == 2**63  # ids 0 .. 2**63 - 1
    assert words(ValueError, SelfTeacher, student_pass, 2**63 + 1, K, context="hint").startswith(
        "SelfTeacher(vocab_size=9223372036854775809…) is past any vocabulary")
    assert SelfTeacher(student_pass, V, K, context="hint", padded_vocab_size=V).padded_vocab_size == V
    assert SelfTeacher(student_pass, V, K, context="hint", temperature=1e-308).temperature == 1e-308  # 1/t finite


@pytest.mark.parametrize("top_k", [V - 1, V - 2])
def test_a_top_k_of_every_id_but_one_scores_the_last_as_the_tail(top_k):
    """top_k = V - 1: the op's ids (the top-k and the token) would be V wide, which it refuses (the
    tail would be empty); the token is then one of the top-k or the one id outside them (the tail)."""
    batch, given = batch_and_hidden()
    first = batch.sequences[0].clone()  # sample 0's first response token: its row's least likely id (the tail's)
    first[batch.response_starts[0]] = (given.hidden[0][0] @ given.output_weight[:V].T).argmin()
    batch = TeacherBatch([first, batch.sequences[1]], batch.response_starts)
    scores = SelfTeacher(lambda asked: given, V, top_k, context="hint").score(batch)
    among = (scores.topk_ids[0] == first[batch.response_starts[0]:, None]).any(1)
    assert not among[0] and among[1:].all()
    for i, one in enumerate(given.hidden):
        want = torch.log_softmax((one @ given.output_weight.T)[:, :V], dim=-1)
        ids = want.topk(top_k, dim=-1).indices
        tokens = batch.sequences[i][batch.response_starts[i]:]
        assert torch.equal(scores.topk_ids[i], ids)
        for got, expected in ((scores.topk_log_probs[i], want.gather(1, ids)),
                              (scores.token_log_probs[i], want.gather(1, tokens[:, None])[:, 0]),
                              (scores.tail_log_probs[i], want.scatter(1, ids, -torch.inf).logsumexp(-1))):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_the_hosts_self_teacher_takes_its_pass_and_layout_or_is_refused_naming_where():
    def student_pass(batch):
        return []

    host = LoopHost(V, student_pass=student_pass)
    teacher = self_teacher(host, ScoringPlan(K, 0.5), "hint", "entry 'student;context=hint'")
    assert (teacher.student_pass, teacher.vocab_size, teacher.top_k, teacher.temperature, teacher.context,
            teacher.tp_group, teacher.padded_vocab_size) == (student_pass, V, K, 0.5, "hint", None, None)
    group = object()  # the host's tensor-parallel group, handed on as it is (read only with a world)
    laid_out = SimpleNamespace(student_pass=student_pass, vocab_size=V, tp_group=group, padded_vocab_size=PADDED)
    teacher = self_teacher(laid_out, ScoringPlan(K), "hint", "entry 'student;context=hint'")
    assert (teacher.tp_group, teacher.padded_vocab_size) == (group, PADDED)
    assert words(ValueError, self_teacher, LoopHost(V), ScoringPlan(K), "hint", "entry 'student;context=hint'") == (
        "entry 'student;context=hint': the live self-teacher scores through the host's own pass of the student's "
        "model: give the host one (LoopHost(vocab_size, ..., student_pass=fn): fn(batch) -> StudentHidden of the "
        "student's current weights on the batch's response rows: hidden states [R_i, H] and the output layer's "
        "weight)")


def test_a_tensor_parallel_group_outside_a_world_scores_as_one_rank():
    """The host's group is read only inside a torch.distributed world (a group of one is none to the ops):
    handed on outside one, the scores are the whole weight's (issue 105 item 10)."""
    batch, given = batch_and_hidden()
    alone = SelfTeacher(lambda asked: given, V, K, context="hint").score(batch)
    grouped = SelfTeacher(lambda asked: given, V, K, context="hint", tp_group=object()).score(batch)
    assert all(torch.equal(a, b) for a, b in zip(alone.topk_log_probs + alone.tail_log_probs,
                                                 grouped.topk_log_probs + grouped.tail_log_probs))
