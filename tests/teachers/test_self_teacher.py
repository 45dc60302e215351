"""The live self-teacher (`student;context=KEY`, `teachers.SelfTeacher`) in the public teacher step,
on a real megatron-core GPTModel on CPU at 1 rank: its pass is the host's own pass of the student's
model over the privileged sequences (no copy of the weights: its final hidden states and output
layer, no logits); its per-token terms equal the same
weights' float64 forward on context + response; the student's gradients through the step's loss
equal the float64 reference with the teacher's terms detached (and miss it when they are not: no
gradient flows through the teacher's pass); negative controls (no context, context shifted by one
token) miss by far. The entry's refusals by name."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import topk_kl, topk_logprobs
from megatron_rl_patches.teachers import LoopHost, SelfTeacher, StudentHidden, TeacherBatch, TeacherStep, build_teachers
from megatron_rl_patches.teachers.kinds import parse_entry

V, K = 50, 6
BOUND, MISS = 1e-5, 1e-3


@pytest.mark.parametrize(("entry", "words"), [
    ("student", "needs a privileged context, 'student;context=KEY'"),
    ("student;tp=2;context=x", "unknown option(s) ['tp=2']"),
    ("student;context=", "names no key"),
])
def test_the_self_teachers_entry_refused_by_name(entry, words):
    with pytest.raises(ValueError) as error:
        parse_entry(entry)
    assert words in str(error.value)


def test_the_entry_and_its_neighbours():
    assert (parse_entry(" student ; context=solution").kind, parse_entry("student;context=solution").context) == \
        ("student", "solution")
    assert parse_entry("./student").kind == "checkpoint" and parse_entry("/ckpt/student;context=s").kind == "checkpoint"


def test_built_from_the_host_or_refused_naming_the_entry():
    def student_pass(batch):
        return StudentHidden([torch.zeros(batch.response_rows(i), 4) for i in range(len(batch))], torch.zeros(V, 4))

    (teacher,) = build_teachers("student;context=hint", LoopHost(V, student_pass=student_pass), top_k=K)
    assert isinstance(teacher, SelfTeacher) and teacher.context == "hint" and teacher.student_pass is student_pass
    with pytest.raises(ValueError, match=r"entry 'student;context=hint': .*LoopHost\(vocab_size, ..., student_pass"):
        build_teachers("student;context=hint", LoopHost(V), top_k=K)
    with pytest.raises(ValueError, match=r"SelfTeacher\(context=None\): .* the student scoring itself"):
        SelfTeacher(student_pass, V, K, context=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"LoopHost\(student_pass=...\) must be a callable"):
        LoopHost(V, student_pass=3)  # type: ignore[arg-type]


def test_a_pass_of_the_wrong_shape_named():
    batch = TeacherBatch([torch.tensor([1, 2, 3])], [1])
    teacher = SelfTeacher(lambda b: StudentHidden([torch.zeros(1, 4)], torch.zeros(V, 4)), V, K, context="hint")
    with pytest.raises(ValueError, match=r"returned hidden states \(1, 4\) torch.float32 for sample 0: expected its 2 "
                                         r"response rows"):
        teacher.score(batch)
    with pytest.raises(ValueError, match=r"returned 0 hidden-state tensors for a batch of 1 samples"):
        SelfTeacher(lambda b: StudentHidden([], torch.zeros(V, 4)), V, K, context="hint").score(batch)
    with pytest.raises(ValueError, match=r"returned list: return StudentHidden\(hidden=.*never logits"):
        SelfTeacher(lambda b: [torch.zeros(2, V)], V, K, context="hint").score(batch)


def logits_rows(model, ids: torch.Tensor, start: int) -> torch.Tensor:
    """The GPTModel's logits [R, V] of the rows that score ids[start:] (causal mask by default)."""
    out = model(ids[None], torch.arange(len(ids))[None], None)
    return out[0, start - 1:-1, :V]


def student_batch() -> tuple[TeacherBatch, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    lengths, starts, contexts = [12, 20], [4, 7], [9, 15]
    batch = TeacherBatch([torch.randint(0, V, (n,), generator=gen) for n in lengths], starts)
    return batch, [torch.randint(0, V, (n,), generator=gen) for n in contexts]


def float64_terms(model64, batch: TeacherBatch, i: int, context: torch.Tensor, detach: bool = True) -> torch.Tensor:
    """The float64 model's log-probs [R, V] of sample i's response rows after `context`."""
    response = batch.sequences[i][batch.response_starts[i]:]
    rows = torch.log_softmax(logits_rows(model64, torch.cat([context, response]), len(context)), dim=-1)
    return rows.detach() if detach else rows


def bucket_forward_kl(student: torch.Tensor, teacher: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The (k+1)-bucket forward KL summed over rows, float64: [R, V] log-probs, the teacher's ids [R, K]."""
    def buckets(log_probs: torch.Tensor) -> torch.Tensor:
        tail = torch.logsumexp(log_probs.scatter(1, ids, float("-inf")), dim=-1, keepdim=True)
        return torch.cat([log_probs.gather(1, ids), tail], 1)

    t, s = buckets(teacher), buckets(student)
    return (t.exp() * (t - s)).sum()


@pytest.mark.megatron
def test_the_live_self_teacher_on_a_real_gpt_model_equals_float64_and_passes_no_gradient():
    from megatron_rl_patches.testing.megatron_cpu import build_tiny_gpt, megatron_on_cpu
    from megatron_rl_patches.testing.student_hidden import response_hidden

    batch, contexts = student_batch()
    with megatron_on_cpu():
        model = build_tiny_gpt(vocab_size=V, seq_length=64, seed=0)
        model64 = build_tiny_gpt(vocab_size=V, seq_length=64, seed=0).double()  # the same weights, float64
        passes: list[bool] = []

        megatron_rl_patches.apply(only="gpt_output_processor")  # megatron-core < 0.18: its output_processor= hook

        def student_pass(privileged: TeacherBatch) -> StudentHidden:  # the host's own pass: the model itself
            passes.append(torch.is_grad_enabled())
            return response_hidden(model, privileged)

        host = LoopHost(V, student_pass=student_pass)
        (teacher,) = build_teachers("student;context=hint", host, top_k=K)
        step = TeacherStep([teacher], host)
        step.send(batch, contexts={"hint": contexts})
        (scores,) = step.collect()
        assert passes == [False]  # the teacher's pass ran without autograd
        # the student's step: its own sequences, the (k+1)-bucket forward KL against the teacher's buckets
        loss = torch.zeros(())
        for i, (ids, start) in enumerate(zip(batch.sequences, batch.response_starts)):
            s_logp, s_tail = topk_logprobs(logits_rows(model, ids, start), scores.topk_ids[i])
            loss = loss + topk_kl(s_logp, s_tail, scores.topk_log_probs[i].float(), scores.tail_log_probs[i].float(),
                                  divergence="forward_kl").sum()
        loss.backward()
        grads = {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}

        def reference(detach: bool, shift: int = 0) -> tuple[torch.Tensor, dict]:
            model64.zero_grad()
            total, terms = torch.zeros((), dtype=torch.float64), []
            for i, (ids, start) in enumerate(zip(batch.sequences, batch.response_starts)):
                teacher64 = float64_terms(model64, batch, i, torch.roll(contexts[i], shift), detach)
                student64 = torch.log_softmax(logits_rows(model64, ids, start), dim=-1)
                total = total + bucket_forward_kl(student64, teacher64, scores.topk_ids[i])
                terms.append(teacher64.detach())
            total.backward()
            return terms, {name: p.grad.clone() for name, p in model64.named_parameters() if p.grad is not None}

        terms, reference_grads = reference(detach=True)
        for i, ref in enumerate(terms):  # the teacher's per-token terms: float64 on context + response
            response = batch.sequences[i][batch.response_starts[i]:]
            assert scores.token_log_probs[i].shape == (batch.response_rows(i),)
            torch.testing.assert_close(scores.token_log_probs[i], ref.gather(1, response[:, None])[:, 0], rtol=0,
                                       atol=BOUND)
            torch.testing.assert_close(scores.topk_log_probs[i], ref.gather(1, scores.topk_ids[i]), rtol=0,
                                       atol=BOUND)
            torch.testing.assert_close(scores.tail_log_probs[i],
                                       torch.log1p(-ref.gather(1, scores.topk_ids[i]).exp().sum(1)), rtol=0,
                                       atol=BOUND)
        assert grads.keys() == reference_grads.keys() and grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], rtol=1e-4, atol=BOUND, msg=name)
        # negative controls: a gradient through the teacher's side, the teacher without its context or shifted
        _, leaked = reference(detach=False)
        assert max(float((leaked[n] - reference_grads[n]).abs().max()) for n in grads) > MISS
        shifted, _ = reference(detach=True, shift=1)
        for control in (shifted, [torch.log_softmax(logits_rows(model64, ids, start), -1).detach()
                                  for ids, start in zip(batch.sequences, batch.response_starts)]):
            missed = max(float((scores.token_log_probs[i] - ref.gather(
                1, batch.sequences[i][batch.response_starts[i]:, None])[:, 0]).abs().max())
                for i, ref in enumerate(control))
            assert missed > MISS, missed
