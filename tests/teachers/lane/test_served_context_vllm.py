"""Served teachers with a privileged context, against the real vLLM servers of the lane (conftest.py:
the generate server and the pooling one of the same checkpoint), through the public teacher step:
each teacher's per-token terms on the student's response rows equal transformers' float64 forward
on the privileged sequence (context + response), top-k with its exact tail and the whole vocabulary
through the head; negative controls (the teacher without its context, the context shifted by one
token) miss by far more than the bound. One step, every teacher in it."""
from __future__ import annotations

import copy

import pytest
import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, TeacherBatch, TeacherStep, local_host
from tests.teachers.lane.served_kit import MAX_LOGPROBS, VOCAB

K = MAX_LOGPROBS
FAST = ClientSettings(retries=1, backoff_s=0.1, deadline_s=120.0)
TOPK_BOUND, HEAD_BOUND, MISS = 1e-4, 1e-5, 1e-2  # the controls must miss by 100x the top-k bound


def student_and_contexts() -> tuple[TeacherBatch, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    lengths, starts, context_lengths = [14, 30, 6], [4, 10, 2], [9, 25, 3]
    batch = TeacherBatch([torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths], starts)
    return batch, [torch.randint(0, VOCAB, (n,), generator=gen) for n in context_lengths]


def float64_rows(model64, context: torch.Tensor | None, batch: TeacherBatch, i: int) -> torch.Tensor:
    """transformers' float64 log-softmax [R, V] of sample i's response rows after `context` (None:
    the student's own prompt)."""
    start = batch.response_starts[i]
    prefix = batch.sequences[i][:start] if context is None else context
    ids = torch.cat([prefix, batch.sequences[i][start:]])
    with torch.no_grad():
        logits = model64(ids[None]).logits[0]
    return torch.log_softmax(logits, dim=-1)[len(prefix) - 1:-1]


@pytest.fixture(scope="module")
def stepped(served, pooled):
    batch, contexts = student_and_contexts()
    shifted = [torch.roll(c, 1) for c in contexts]  # the same ids, each one position later
    with ServedTeacher(served.url, top_k=K, client=FAST, context="hint") as topk, \
            ServedTeacher(pooled.url, head=pooled.directory, top_k=K, client=FAST, context="hint") as whole, \
            ServedTeacher(served.url, top_k=K, client=FAST) as plain, \
            ServedTeacher(served.url, top_k=K, client=FAST, context="shifted") as off:
        step = TeacherStep([topk, whole, plain, off], local_host(VOCAB))
        step.send(batch, contexts={"hint": contexts, "shifted": [c.tolist() for c in shifted]})
        scores = step.collect()
    model64 = copy.deepcopy(served.model).double()
    reference = [float64_rows(model64, contexts[i], batch, i) for i in range(len(batch))]
    return batch, scores, reference


def token_terms(reference: torch.Tensor, batch: TeacherBatch, i: int) -> torch.Tensor:
    return reference.gather(1, batch.sequences[i][batch.response_starts[i]:, None])[:, 0]


def test_top_k_with_its_tail_equals_float64_on_the_privileged_sequence(stepped):
    batch, (topk, _, _, _), reference = stepped
    for i, ref in enumerate(reference):
        assert topk.token_log_probs[i].shape == (batch.response_rows(i),)  # the student's rows, one to one
        torch.testing.assert_close(topk.token_log_probs[i], token_terms(ref, batch, i), rtol=0, atol=TOPK_BOUND)
        torch.testing.assert_close(topk.topk_log_probs[i], ref.gather(1, topk.topk_ids[i]), rtol=0, atol=TOPK_BOUND)
        complement = 1 - ref.gather(1, topk.topk_ids[i]).exp().sum(1)
        torch.testing.assert_close(topk.tail_log_probs[i].exp(), complement, rtol=0, atol=TOPK_BOUND)


def test_the_whole_vocabulary_through_the_head_equals_float64(stepped):
    batch, (_, whole, _, _), reference = stepped
    for i, ref in enumerate(reference):
        torch.testing.assert_close(whole.token_log_probs[i].double(), token_terms(ref, batch, i), rtol=0,
                                   atol=HEAD_BOUND)
        torch.testing.assert_close(whole.topk_log_probs[i].double(), ref.gather(1, whole.topk_ids[i]), rtol=0,
                                   atol=HEAD_BOUND)
        torch.testing.assert_close(whole.tail_log_probs[i].double(),
                                   torch.log1p(-ref.gather(1, whole.topk_ids[i]).exp().sum(1)), rtol=0,
                                   atol=HEAD_BOUND)


def test_without_its_context_or_shifted_by_one_token_the_teacher_misses(stepped):
    batch, (_, _, plain, off), reference = stepped
    for control in (plain, off):
        missed = max(float((control.token_log_probs[i] - token_terms(ref, batch, i)).abs().max())
                     for i, ref in enumerate(reference))
        assert missed > MISS, missed
