"""A served teacher with another tokenizer (`teachers.cross_buckets.served_buckets`): from an
engine's top-k of the teacher's rows alone, the chunk-start buckets equal the in-process teacher's
(its top-k ids, then its bucket ids scored) where every teacher id of a bucket was returned — every
bucket when each shared string has one teacher id (Qwen3 -> DeepSeek) — and a bucket with a teacher
id the engine did not return is folded into the tail on both sides (a byte-fallback teacher: a byte
spelled by `<0x61>` and `a`), its divergence term then over the coarser partition, exactly."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("tokenizers")

from megatron_rl_patches import cross_tokenizer as xt  # noqa: E402
from megatron_rl_patches.ops.lm_head import lm_head_topk_logprobs  # noqa: E402
from megatron_rl_patches.teachers.cross_buckets import served_buckets  # noqa: E402
from tests.cross_tokenizer.conftest import TEXTS  # noqa: E402

H, K = 8, 4


def _sample(pair, text: str):
    tok = pair.student_tokenizer
    prompt = tok.encode("Q: ", add_special_tokens=False).ids
    answer = tok.encode(text, add_special_tokens=False).ids
    return pair.sample(torch.tensor(prompt + answer), len(answer), torch.ones(len(answer), dtype=torch.int))


def _teacher_rows(pair, sample, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's hidden rows and output layer (float64), and its dense log-softmax rows."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(sample.response_length, H, generator=g, dtype=torch.float64) * 2
    weight = torch.randn(pair.tokenizer.get_vocab_size(), H, generator=g, dtype=torch.float64)
    return hidden, weight, torch.log_softmax(hidden @ weight.T, dim=-1)


def _in_process(pair, sample, hidden, weight, top):
    buckets = xt.chunk_start_buckets(top, sample.alignment, pair.shared)
    lp, tail = lm_head_topk_logprobs(hidden, weight, buckets.teacher_ids, ids_mask=buckets.teacher_mask)
    return buckets, *xt.teacher_buckets_on_student_rows(lp, tail, buckets, sample.alignment)


@pytest.mark.parametrize("returned", [K, 20])
def test_served_buckets_equal_the_in_process_teachers_when_strings_have_one_teacher_id(qwen3, deepseek, returned):
    pair = xt.cross_teacher(qwen3, deepseek)
    assert pair.shared.most_ids("teacher") == 1
    sample = _sample(pair, TEXTS["mixed"] + TEXTS["chinese"])
    hidden, weight, dense = _teacher_rows(pair, sample, 1)
    top_lp, top_ids = dense.float().topk(returned, dim=-1)  # an engine's fp32 reply
    served = served_buckets(top_ids, top_lp, sample, pair.shared, K)
    buckets, values, tails = _in_process(pair, sample, hidden, weight, top_ids[:, :K])
    assert served.folded == 0
    for name in ("teacher_ids", "teacher_mask", "student_ids", "student_mask", "alive"):
        assert torch.equal(getattr(served.buckets, name), getattr(buckets, name)), name
    assert buckets.alive.sum() > 0
    alive = buckets.alive
    torch.testing.assert_close(served.log_probs[alive], values[alive], rtol=0, atol=1e-6)
    assert torch.equal(served.log_probs[~alive], values[~alive])  # -inf
    torch.testing.assert_close(served.tails, tails, rtol=0, atol=1e-5)  # the mass within fp32's rounding


def test_a_bucket_with_a_teacher_id_the_engine_did_not_return_is_folded_into_the_tail(qwen3, spm_never):
    # the teacher a byte-fallback BPE: a byte string has two teacher ids (`a` and `<0x61>`)
    pair = xt.cross_teacher(qwen3, spm_never)
    assert pair.shared.most_ids("teacher") == 2
    sample = _sample(pair, "a lazy fox")
    hidden, weight, dense = _teacher_rows(pair, sample, 2)
    top_lp, top_ids = dense.topk(K, dim=-1)
    # at every chunk start, make the teacher's best id a two-id string whose other id ranks last
    shared, (_, t_rows) = pair.shared, sample.alignment.chunk_starts()
    offsets, ids = shared.teacher_offsets, shared.teacher_ids
    pairs = [(int(ids[offsets[g]]), int(ids[offsets[g] + 1])) for g in range(offsets.numel() - 1)
             if offsets[g + 1] - offsets[g] == 2]
    assert pairs
    logits = hidden @ weight.T
    for row in t_rows.tolist():
        kept, other = pairs[row % len(pairs)]
        logits[row, kept] = logits[row].max() + 3.0
        logits[row, other] = logits[row].min() - 3.0
    dense = torch.log_softmax(logits, dim=-1)
    top_lp, top_ids = dense.topk(K, dim=-1)
    served = served_buckets(top_ids, top_lp, sample, shared, K)
    full = xt.chunk_start_buckets(top_ids, sample.alignment, shared)
    s_rows = sample.alignment.chunk_starts()[0]
    assert served.folded >= len(t_rows) > 0
    assert full.alive[s_rows].sum() - served.buckets.alive[s_rows].sum() == served.folded
    inexact = 0
    # the float64 reference: per chunk start, each bucket whose teacher ids all came back, and the tail
    returned = {row: set(top_ids[row].tolist()) for row in t_rows.tolist()}
    for s_row, t_row in zip(s_rows.tolist(), t_rows.tolist()):
        strings = sorted({int(shared.teacher_string[i]) for i in top_ids[t_row].tolist()} - {-1})
        exact = [g for g in strings if set(ids[offsets[g]:offsets[g + 1]].tolist()) <= returned[t_row]]
        inexact += len(strings) - len(exact)
        assert len(exact) < len(strings)  # the planted one at least
        want = [dense[t_row, ids[offsets[g]:offsets[g + 1]]].exp().sum() for g in exact]
        got = served.log_probs[s_row][served.buckets.alive[s_row]].exp()
        torch.testing.assert_close(got.sort().values, torch.stack(want).sort().values, rtol=1e-12, atol=0)
        torch.testing.assert_close(served.tails[s_row].exp(), 1 - sum(want), rtol=1e-9, atol=0)
        # the folded bucket's student ids are out of the student's buckets too (its tail holds them)
        folded = full.alive[s_row] & ~served.buckets.alive[s_row]
        slots = served.buckets.student_mask[s_row].reshape(K, -1)
        assert folded.sum() == len(strings) - len(exact) and not slots[folded].any()
        assert slots[served.buckets.alive[s_row]].any()
    assert inexact == served.folded
    # a negative control: with the engine returning the last-ranked id too, nothing folds
    more_lp, more_ids = dense.topk(pair.tokenizer.get_vocab_size(), dim=-1)
    assert served_buckets(more_ids, more_lp, sample, shared, K).folded == 0


def test_served_buckets_refuse_a_reply_narrower_than_k(qwen3, deepseek):
    pair = xt.cross_teacher(qwen3, deepseek)
    sample = _sample(pair, TEXTS["mixed"])
    _, _, dense = _teacher_rows(pair, sample, 3)
    top_lp, top_ids = dense.topk(K - 1, dim=-1)
    asked = f"returned {K - 1} ids per row and k={K} buckets are asked: ask the engine for at least k$"
    with pytest.raises(ValueError, match=asked):
        served_buckets(top_ids, top_lp, sample, pair.shared, K)
    with pytest.raises(ValueError, match="one \\[R_teacher, K\\] shape"):
        served_buckets(top_ids, top_lp[:, :1], sample, pair.shared, 1)
