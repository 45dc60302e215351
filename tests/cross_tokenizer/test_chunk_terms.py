"""What a loop that runs the teacher's passes itself composes (`cross_teacher`, `teacher_passes`,
`chunk_distillation_terms`): on real tokenizers, the per-token terms from the teacher's values
brought back to the student's rows equal part 1's single-sample definitions
(`chunk_start_topk_divergence` + `chunk_reverse_kl`), value and gradient."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("tokenizers")

from megatron_rl_patches import cross_tokenizer as xt  # noqa: E402
from megatron_rl_patches.ops.lm_head import (  # noqa: E402
    lm_head_log_probs_and_entropy,
    lm_head_topk_ids,
    lm_head_topk_logprobs,
)
from tests.cross_tokenizer.conftest import TEXTS  # noqa: E402

H, K = 8, 4


def _head(vocab: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, H, generator=g, dtype=torch.float64) * 2,
            torch.randn(vocab, H, generator=g, dtype=torch.float64))


@pytest.fixture(scope="module")
def pair(qwen3, deepseek):
    return xt.cross_teacher(qwen3, deepseek)  # a Tokenizer and a checkpoint directory


def test_cross_teacher_reads_the_pair_once(pair, qwen3, deepseek):
    assert pair.student_tokenizer is xt.load_tokenizer(qwen3) and pair.tokenizer is xt.load_tokenizer(deepseek)
    shared = xt.shared_strings(qwen3, deepseek)
    for side in ("student_ids", "teacher_ids", "student_offsets", "teacher_offsets"):
        assert torch.equal(getattr(pair.shared, side), getattr(shared, side)), side
    tok = xt.load_tokenizer(qwen3)
    ids = torch.tensor(tok.encode("Q: " + TEXTS["english"], add_special_tokens=False).ids)
    response = len(tok.encode(TEXTS["english"], add_special_tokens=False).ids)
    mask = torch.ones(response, dtype=torch.int)
    sample, direct = pair.sample(ids, response, mask), xt.teacher_sample(ids, response, mask, qwen3, deepseek)
    assert torch.equal(sample.tokens, direct.tokens) and sample.response_length == direct.response_length
    assert torch.equal(sample.alignment.student_chunk, direct.alignment.student_chunk)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_chunk_terms_from_brought_back_values_equal_part_one(pair, qwen3, divergence):
    tok = xt.load_tokenizer(qwen3)
    prompt = tok.encode("Q: ", add_special_tokens=False).ids
    answer = tok.encode(TEXTS["mixed"] + TEXTS["chinese"], add_special_tokens=False).ids
    sample = pair.sample(torch.tensor(prompt + answer), len(answer), torch.ones(len(answer), dtype=torch.int))
    alignment, t_ids = sample.alignment, sample.tokens[-sample.response_length:]
    h, w = _head(tok.get_vocab_size(), len(answer), 0)
    th, tw = _head(pair.tokenizer.get_vocab_size(), sample.response_length, 1)
    h.requires_grad_()
    ids = torch.tensor(answer)

    # the teacher's passes: its top-k ids, its buckets' ids scored, its own tokens' log-probs
    buckets = xt.chunk_start_buckets(lm_head_topk_ids(th, tw, K), alignment, pair.shared)
    t_lp, t_tail = lm_head_topk_logprobs(th, tw, buckets.teacher_ids, ids_mask=buckets.teacher_mask)
    values, tails = xt.teacher_buckets_on_student_rows(t_lp, t_tail, buckets, alignment)
    t_tok = lm_head_log_probs_and_entropy(th, tw, t_ids)[0]
    # the student's step: its log-probs of every bucket's ids and of its own tokens
    s_lp, s_tail = lm_head_topk_logprobs(h, w, buckets.student_ids, ids_mask=buckets.student_mask)
    s_tok = lm_head_log_probs_and_entropy(h, w, ids)[0]
    terms = xt.chunk_distillation_terms(s_lp, buckets.student_mask, s_tail, values, tails, buckets.alive,
                                        xt.log_ratio(s_tok, t_tok, alignment), s_tok, divergence)

    expected = xt.chunk_start_topk_divergence(h, w, th, tw, alignment, pair.shared, k=K, divergence=divergence) + \
        xt.chunk_reverse_kl(lm_head_log_probs_and_entropy(h, w, ids)[0], t_tok, alignment)
    torch.testing.assert_close(terms, expected.to(terms), rtol=1e-9, atol=1e-12)
    (grad,) = torch.autograd.grad(terms.sum(), h)
    (want,) = torch.autograd.grad(expected.sum(), h)
    torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-12)
    starts, _ = alignment.chunk_starts()
    assert terms[starts].abs().sum() > 0 and grad.abs().sum() > 0
    # the bucket divergence lives at chunk starts only: elsewhere the token term alone
    elsewhere = torch.ones_like(terms, dtype=torch.bool).index_fill(0, starts, False)
    token = xt.chunk_reverse_kl(s_tok, t_tok, alignment)
    assert elsewhere.any() and torch.equal(terms[elsewhere], token[elsewhere].to(terms))
    assert not torch.allclose(terms[starts], token[starts].to(terms))


def test_masked_tail_is_the_mass_left_outside_the_masked_in_ids():
    log_probs = torch.log(torch.tensor([[0.2, 0.3, 0.1], [0.5, 0.25, 0.2]], dtype=torch.float64))
    mask = torch.tensor([[True, True, False], [True, False, True]])
    torch.testing.assert_close(xt.masked_tail(log_probs, mask).exp(), torch.tensor([0.5, 0.3], dtype=torch.float64))
