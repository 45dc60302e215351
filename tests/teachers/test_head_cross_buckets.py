"""A served head teacher of another tokenizer (`teachers.head.cross_buckets.head_buckets`): from the hidden states a
pooling server sends for the teacher's own encoding (projected by `hidden_scores.head_scores`, the
code `ServedTeacher(head=...)` runs on a reply), every chunk-start bucket equals the in-process
teacher's (its top-k ids, then every bucket id scored through its output layer), on a byte-fallback
teacher pair whose buckets hold two teacher ids (`a` and `<0x61>`) and where the second id ranks
far below the top-k: the folding route (`served_buckets`, the engine's top-k only) fails the same
check. The real server's run is the slime lane's (`test_slime_opd_served_head_cross_lane.py`)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("tokenizers")

from megatron_rl_patches import cross_tokenizer as xt  # noqa: E402
from megatron_rl_patches.ops.lm_head import lm_head_topk_logprobs  # noqa: E402
from megatron_rl_patches.ops.scoring_plan import ScoringPlan  # noqa: E402
from megatron_rl_patches.teachers import BatchScores, TeacherHead, head_buckets, served_buckets  # noqa: E402
from megatron_rl_patches.teachers.head.cross_buckets import cross_batch  # noqa: E402
from megatron_rl_patches.teachers.served.hidden_states import head_scores  # noqa: E402
from tests.cross_tokenizer.conftest import TEXTS, sentencepiece_like  # noqa: E402

H, K, TAU = 8, 4, 0.7


@pytest.fixture(scope="module")
def world():
    """The pair (student: no dummy prefix; teacher: the same byte-fallback BPE with one), three
    samples, and a float64 teacher head whose hidden states make, at every chunk start, one id of
    a two-id string the best and its other id a small mass outside the top-k."""
    student = sentencepiece_like("never")
    pair = xt.cross_teacher(student, sentencepiece_like("first"))
    shared = pair.shared
    assert shared.most_ids("teacher") == 2
    prompt = student.encode("Q: ", add_special_tokens=False).ids
    samples = []
    for text in ("a lazy fox", TEXTS["mixed"], "the dog"):
        answer = student.encode(text, add_special_tokens=False).ids
        samples.append(pair.sample(torch.tensor(prompt + answer), len(answer), torch.ones(len(answer))))
    offsets, ids = shared.teacher_offsets, shared.teacher_ids
    kept, other = next((int(ids[offsets[g]]), int(ids[offsets[g] + 1])) for g in range(offsets.numel() - 1)
                       if offsets[g + 1] - offsets[g] == 2)
    gen = torch.Generator().manual_seed(7)
    vocab = pair.tokenizer.get_vocab_size()
    weight = torch.randn(vocab, H + 1, generator=gen, dtype=torch.float64) * 0.5
    weight[:, H] = 0.0
    weight[kept, H], weight[other, H] = 6.0, -2.0 # along the last dimension: `kept` first, `other` far below
    states = []
    for s in samples:
        hidden = torch.randn(s.alignment.teacher_chunk.numel(), H + 1, generator=gen, dtype=torch.float64)
        hidden[:, H] = 0.0
        hidden[s.alignment.chunk_starts()[1], H] = 1.0
        states.append(hidden)
    head = TeacherHead(weight, vocab, vocab, 0, source="in-memory")
    scores = head_scores(head, cross_batch(samples), states, ScoringPlan(K, TAU))
    return pair, samples, head, states, scores, (kept, other)


def in_process(pair, sample, hidden, weight, top):
    """The in-process teacher's buckets (as `cross_passes` runs them): its top-k ids, then each
    bucket's teacher ids scored through its output layer, brought to the student's rows."""
    buckets = xt.chunk_start_buckets(top, sample.alignment, pair.shared)
    lp, tail = lm_head_topk_logprobs(hidden, weight, buckets.teacher_ids, ids_mask=buckets.teacher_mask,
                                     temperature=TAU)
    return buckets, *xt.teacher_buckets_on_student_rows(lp, tail, buckets, sample.alignment)


def test_every_bucket_equals_the_in_process_teachers(world):
    pair, samples, head, states, scores, (kept, other) = world
    got = head_buckets(head, scores, samples, pair.shared, K, temperature=TAU)
    alive = 0
    for sample, hidden, own, top in zip(samples, states, got, scores.topk_ids):
        dense = torch.log_softmax(hidden @ head.weight.T / TAU, dim=-1)
        t_rows = sample.alignment.chunk_starts()[1]
        assert (dense[t_rows, kept] > dense[t_rows, other] + 3).all()
        assert not (top[t_rows] == other).any()  # outside the top-k: an engine would not return it
        buckets, values, tails = in_process(pair, sample, hidden, head.weight, dense.topk(K, dim=-1).indices)
        assert own.folded == 0
        for name in ("teacher_ids", "teacher_mask", "student_ids", "student_mask", "alive"):
            assert torch.equal(getattr(own.buckets, name), getattr(buckets, name)), name
        live = buckets.alive
        alive += int(live.sum())
        torch.testing.assert_close(own.log_probs[live], values[live], rtol=0, atol=1e-12)
        assert torch.equal(own.log_probs[~live], values[~live])  # -inf
        torch.testing.assert_close(own.tails, tails, rtol=0, atol=1e-12)
    assert alive > 0


def test_the_folding_route_fails_the_same_check(world):
    """A negative control: the engine's top-k alone (`served_buckets`) folds the two-id buckets, so
    its buckets and tails are not the in-process teacher's."""
    pair, samples, head, states, scores, _ = world
    exact = head_buckets(head, scores, samples, pair.shared, K, temperature=TAU)
    folded = [served_buckets(ids, values, s, pair.shared, K)
              for ids, values, s in zip(scores.topk_ids, scores.topk_log_probs, samples)]
    assert sum(f.folded for f in folded) >= len(samples)
    assert any(not torch.equal(f.buckets.alive, e.buckets.alive) for f, e in zip(folded, exact))
    assert max((f.tails - e.tails).abs().max().item() for f, e in zip(folded, exact)) > 1e-3


def test_refusals_by_name(world):
    pair, samples, head, _, scores, _ = world
    topk_only = BatchScores(scores.token_log_probs, scores.topk_ids, scores.topk_log_probs, scores.tail_log_probs)
    with pytest.raises(ValueError, match="hidden_states.*folds buckets"):
        head_buckets(head, topk_only, samples, pair.shared, K)
    with pytest.raises(ValueError, match=f"top-{K} and k={K + 1} buckets are asked.*top_k >= {K + 1}"):
        head_buckets(head, scores, samples, pair.shared, K + 1)
    with pytest.raises(ValueError, match="2 samples but 3 scored"):
        head_buckets(head, scores, samples[:2], pair.shared, K)
    with pytest.raises(ValueError, match="sample 0 has .* teacher response rows"):
        head_buckets(head, scores, samples[1:2] + samples[1:], pair.shared, K)
    with pytest.raises(TypeError, match="TeacherHead"):
        head_buckets(head.weight, scores, samples, pair.shared, K)
