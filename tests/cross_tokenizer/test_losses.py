"""The cross-tokenizer losses against float64 dense references built from their definitions, on
tiny models (hidden 16) with the real vocabulary sizes: Qwen3 (151,851) → Qwen3.5 (≈248k), and a
SentencePiece-style tokenizer whose byte strings repeat (byte fallback) on both sides."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("tokenizers")

from megatron_rl_patches import cross_tokenizer as ct  # noqa: E402
from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy  # noqa: E402
from tests.cross_tokenizer.conftest import TEXTS  # noqa: E402

H = 16


def model(vocab: int, rows: int, seed: int, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, H, generator=g, dtype=torch.float64) * scale).requires_grad_()
    weight = torch.randn(vocab, H, generator=g, dtype=torch.float64).requires_grad_()
    return hidden, weight


def sample(student, teacher, text):
    ids = ct.load_tokenizer(student).encode(text, add_special_tokens=False).ids
    t_ids, alignment = ct.retokenize(ids, student, teacher)
    return torch.tensor(ids), t_ids, alignment


def test_chunk_reverse_kl_value_and_gradient(qwen3, qwen35):
    ids, t_ids, alignment = sample(qwen3, qwen35, TEXTS["mixed"] + TEXTS["emoji"])
    h, w = model(ct.load_tokenizer(qwen3).get_vocab_size(), len(ids), 0)
    th, tw = model(ct.load_tokenizer(qwen35).get_vocab_size(), len(t_ids), 1)
    s_lp, _ = lm_head_log_probs_and_entropy(h, w, ids)
    with torch.no_grad():
        t_lp, _ = lm_head_log_probs_and_entropy(th, tw, t_ids)
    term = ct.chunk_reverse_kl(s_lp, t_lp, alignment)
    # dense reference: per chunk ℓS_j − ℓT_j; per-token r_i = (ℓS_j − ℓT_j)/|S_j|, gradient r_i ∇log pS(y_i)
    ref_s = torch.log_softmax(h @ w.T, -1).gather(1, ids[:, None]).squeeze(1)
    ref_t = torch.log_softmax(th @ tw.T, -1).gather(1, t_ids[:, None]).squeeze(1).detach()
    sums = [(ref_s[alignment.student_chunk == j].sum() - ref_t[alignment.teacher_chunk == j].sum()).item()
            for j in range(alignment.n_chunks)]
    torch.testing.assert_close(term.sum().item(), sum(sums), rtol=1e-9, atol=1e-9)
    n = torch.bincount(alignment.student_chunk, minlength=alignment.n_chunks).double()
    r = torch.tensor(sums, dtype=torch.float64)[alignment.student_chunk] / n[alignment.student_chunk]
    torch.testing.assert_close(term.detach(), r)
    term.sum().backward()
    grad_h, grad_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    (r * ref_s).sum().backward()
    torch.testing.assert_close(grad_h, h.grad)
    torch.testing.assert_close(grad_w, w.grad)
    assert th.grad is None and tw.grad is None


def dense_reference(h, w, th, tw, alignment, shared, k, divergence):
    """Per chunk-start divergence from full float64 softmaxes, by the definitions."""
    s_rows, t_rows = alignment.chunk_starts()
    ls = torch.log_softmax(h[s_rows] @ w.T, -1)
    lt = torch.log_softmax(th[t_rows] @ tw.T, -1).detach()
    out = []
    for r in range(len(s_rows)):
        top = torch.argsort(lt[r], descending=True)[:k]
        table = shared.teacher_string  # a padded row past the table belongs to no string
        strings = sorted({int(table[i]) if i < table.numel() else -1 for i in top.tolist()} - {-1})
        p, q = [], []
        for g in strings:
            a = shared.student_ids[shared.student_offsets[g]:shared.student_offsets[g + 1]]
            b = shared.teacher_ids[shared.teacher_offsets[g]:shared.teacher_offsets[g + 1]]
            p.append(ls[r, a].exp().sum())
            q.append(lt[r, b].exp().sum())
        p = torch.stack([*p, 1 - sum(p)]) if p else torch.ones(1, dtype=torch.float64)
        q = torch.stack([*q, 1 - sum(q)]) if q else torch.ones(1, dtype=torch.float64)
        if divergence == "forward_kl":
            out.append((q * (q.log() - p.log())).sum())
        else:
            out.append((p * (p.log() - q.log())).sum())
    return s_rows, torch.stack(out)


@pytest.mark.parametrize("pair,divergence", [("qwen", "forward_kl"), ("spm", "reverse_kl")])
def test_chunk_start_topk_divergence_against_dense(pair, divergence, request):
    if pair == "qwen":
        student, teacher = request.getfixturevalue("qwen3"), request.getfixturevalue("qwen35")
        text, k, scale = TEXTS["mixed"], 6, 2.0
    else:  # one tokenizer: every string of <0xNN> and its merged byte is a 2-id bucket on both sides
        student = teacher = request.getfixturevalue("spm")
        text, k, scale = TEXTS["english"] + "🦀", 12, 1.0
    ids, t_ids, alignment = sample(student, teacher, text)
    shared = ct.shared_strings(student, teacher)
    h, w = model(ct.load_tokenizer(student).get_vocab_size(), len(ids), 2, scale)
    th, tw = model(ct.load_tokenizer(teacher).get_vocab_size(), len(t_ids), 3, scale)
    if pair == "spm":  # teacher mass on the repeated single bytes
        dup = torch.nonzero(shared.teacher_offsets.diff() > 1).squeeze(1)
        assert dup.numel() > 0
        with torch.no_grad():
            picks = shared.teacher_ids[shared.teacher_offsets[dup[:4]]]
            tw[picks] = th.mean(0) * 3
    value = ct.chunk_start_topk_divergence(h, w, th, tw, alignment, shared, k=k, divergence=divergence)
    rows, ref = dense_reference(h, w, th, tw, alignment, shared, k, divergence)
    expected = torch.zeros(len(ids), dtype=torch.float64).index_put((rows,), ref)
    torch.testing.assert_close(value, expected.detach(), rtol=1e-7, atol=1e-9)
    assert (value[rows] > 0).any()
    value.sum().backward()
    grad_h, grad_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref.sum().backward()
    torch.testing.assert_close(grad_h, h.grad, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grad_w, w.grad, rtol=1e-6, atol=1e-9)
    assert th.grad is None and tw.grad is None


def dense_full_reference(h, w, th, tw, alignment, shared, divergence):
    """Per chunk-start divergence over every shared string + one tail per model, float64 dense."""
    s_rows, t_rows = alignment.chunk_starts()
    p = torch.softmax(h[s_rows] @ w.T, -1)
    q = torch.softmax(th[t_rows] @ tw.T, -1).detach()

    def buckets(probs, ids, string):
        grouped = probs.new_zeros(probs.size(0), shared.n_strings).index_add(1, string[ids], probs[:, ids])
        outside = torch.ones(probs.size(1), dtype=torch.bool)
        outside[ids] = False
        return torch.cat([grouped, probs[:, outside].sum(1, keepdim=True)], dim=1)

    pb = buckets(p, shared.student_ids, shared.student_string)
    qb = buckets(q, shared.teacher_ids, shared.teacher_string)
    if divergence == "forward_kl":
        return s_rows, torch.where(qb > 0, qb * (qb.log() - pb.log()), 0.0).sum(1)
    return s_rows, torch.where(pb > 0, pb * (pb.log() - qb.log()), 0.0).sum(1)


@pytest.mark.parametrize("pair,divergence", [("qwen", "forward_kl"), ("spm", "reverse_kl")])
def test_chunk_start_full_divergence_against_dense(pair, divergence, request):
    if pair == "qwen":
        student, teacher = request.getfixturevalue("qwen3"), request.getfixturevalue("qwen35")
        text, pad = TEXTS["chinese"] + TEXTS["emoji"], 85  # Qwen's output layer has padded rows
    else:
        student = teacher = request.getfixturevalue("spm")
        text, pad = TEXTS["english"], 0
    ids, t_ids, alignment = sample(student, teacher, text)
    shared = ct.shared_strings(student, teacher)
    h, w = model(ct.load_tokenizer(student).get_vocab_size() + pad, len(ids), 4, 1.0)
    th, tw = model(ct.load_tokenizer(teacher).get_vocab_size(), len(t_ids), 5, 1.0)
    value = ct.chunk_start_full_divergence(h, w, th, tw, alignment, shared, divergence=divergence)
    rows, ref = dense_full_reference(h, w, th, tw, alignment, shared, divergence)
    expected = torch.zeros(len(ids), dtype=torch.float64).index_put((rows,), ref)
    torch.testing.assert_close(value, expected.detach(), rtol=1e-7, atol=1e-10)
    assert (value[rows] > 0).all()
    value.sum().backward()
    grad_h, grad_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref.sum().backward()
    torch.testing.assert_close(grad_h, h.grad, rtol=1e-6, atol=1e-10)
    torch.testing.assert_close(grad_w, w.grad, rtol=1e-6, atol=1e-10)
    assert th.grad is None and tw.grad is None
