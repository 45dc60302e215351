"""row_mask= on every row op: the selected rows equal a call without the mask (bit for bit on
logits; to matmul rounding from hidden states, whose BLAS blocking depends on the rows around),
the unselected rows are 0 with no gradient, dW is the all-rows dW with those rows' upstream
gradient 0, float64 references hold, and bad masks are refused by name."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy, lm_head_topk_ids, lm_head_topk_logprobs
from megatron_rl_patches.ops.logprobs import log_probs_and_entropy
from megatron_rl_patches.ops.topk import topk_ids, topk_logprobs, topk_opd_loss
from megatron_rl_patches.testing.logprob_reference import reference_log_probs

T, V, H, K = 40, 96, 12, 4


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(T, H, generator=g, dtype=dtype)
    w = torch.randn(V, H, generator=g, dtype=dtype)
    tokens = torch.randint(0, V, (T,), generator=g)
    mask = torch.rand(T, generator=g) < 0.35
    a, b = torch.randn(T, generator=g, dtype=dtype), torch.randn(T, generator=g, dtype=dtype)
    return h, w, tokens, mask, a, b


def _assert_rows(full, masked, mask, exact=True):
    for f, m in zip(full, masked):
        if exact:
            assert torch.equal(f[mask], m[mask])
        else:
            torch.testing.assert_close(m[mask], f[mask], rtol=1e-12, atol=1e-12)
        assert bool((m[~mask] == 0).all())


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("tensor_tau", [False, True])
def test_log_probs_selected_rows_bit_for_bit(inplace, tensor_tau):
    h, w, tokens, mask, a, b = _inputs()
    logits = (h @ w.t()) * 2
    tau = torch.rand(T, dtype=torch.float64) + 0.5 if tensor_tau else 0.7
    tokens_bad = tokens.masked_fill(~mask, -100)  # unselected targets are never read

    def run(row_mask, tok):
        leaf = logits.clone().requires_grad_(True)
        x = leaf * 1.0
        lp, ent = log_probs_and_entropy(x, tok, with_entropy=True, temperature=tau, inplace_backward=inplace,
                                        row_mask=row_mask, chunk_size=7)
        (grad,) = torch.autograd.grad((a * lp).sum() + (b * ent).sum(), leaf)
        return lp, ent, grad

    _assert_rows(run(None, tokens), run(mask, tokens_bad), mask)


def test_log_probs_row_mask_against_float64_reference():
    h, w, tokens, mask, a, b = _inputs()
    logits = (h @ w.t()).requires_grad_(True)
    lp, ent = log_probs_and_entropy(logits, tokens, with_entropy=True, row_mask=mask)
    want_lp, want_ent = reference_log_probs(logits.detach(), tokens)
    torch.testing.assert_close(lp[mask], want_lp[mask], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent[mask], want_ent[mask], rtol=1e-12, atol=1e-12)
    ((a * lp).sum() + (b * ent).sum()).backward()
    ref = logits.detach().clone().requires_grad_(True)
    ref_lp, ref_ent = reference_log_probs(ref, tokens)
    ref_loss = (a * ref_lp + b * ref_ent)[mask].sum()
    ref_loss.backward()
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-10, atol=1e-12)


def test_topk_ops_selected_rows():
    h, w, tokens, mask, a, b = _inputs()
    logits = h @ w.t()
    ids = topk_ids(logits, K)
    _assert_rows((ids,), (topk_ids(logits, K, row_mask=mask),), mask)
    teacher = torch.log_softmax(torch.randn(T, K + 1, dtype=torch.float64), -1)

    def run(row_mask):
        x = logits.clone().requires_grad_(True)
        lp, tail = topk_logprobs(x, ids, row_mask=row_mask, temperature=0.9)
        loss = topk_opd_loss(x, ids, teacher[:, :K], teacher[:, K], row_mask=row_mask)
        (grad,) = torch.autograd.grad((lp.sum(1) * a).sum() + (tail * b).sum() + loss.sum(), x)
        return lp, tail, loss, grad

    _assert_rows(run(None), run(mask), mask)


def test_lm_head_ops_selected_rows_and_weight_gradient():
    h, w, tokens, mask, a, b = _inputs()
    zero_a, zero_b = a * mask, b * mask

    def run(row_mask, wa, wb):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = lm_head_log_probs_and_entropy(hh, ww, tokens, with_entropy=True, row_mask=row_mask, chunk_size=8)
        gh, gw = torch.autograd.grad((wa * lp).sum() + (wb * ent).sum(), [hh, ww])
        return lp, ent, gh, gw

    full, sel = run(None, zero_a, zero_b), run(mask, a, b)
    _assert_rows(full[:3], sel[:3], mask, exact=False)
    torch.testing.assert_close(sel[3], full[3], rtol=1e-12, atol=1e-12)  # dW: unselected upstream gradient 0
    ids = lm_head_topk_ids(h.float(), w.float(), K)
    _assert_rows((ids,), (lm_head_topk_ids(h.float(), w.float(), K, row_mask=mask),), mask)

    def topk(row_mask):
        hh = h.clone().requires_grad_(True)
        lp, tail = lm_head_topk_logprobs(hh, w, ids, row_mask=row_mask)
        (gh,) = torch.autograd.grad(lp.sum() + (tail * a).sum(), hh)
        return lp, tail, gh

    _assert_rows(topk(None), topk(mask), mask, exact=False)


def test_no_row_selected_gives_zeros():
    h, w, tokens, _, _, _ = _inputs()
    none = torch.zeros(T, dtype=torch.bool)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = lm_head_log_probs_and_entropy(hh, ww, tokens, with_entropy=True, row_mask=none)
    (lp.sum() + ent.sum()).backward()
    # no tile at all: the weight's gradient (written by tiles, not zero-filled first) is zeroed
    assert bool((lp == 0).all() and (ent == 0).all() and (hh.grad == 0).all() and (ww.grad == 0).all())


@pytest.mark.parametrize("bad, error, words", [
    (torch.ones(T), TypeError, "bool tensor"),
    ([True] * T, TypeError, "bool tensor"),
    (torch.ones(T - 1, dtype=torch.bool), ValueError, "shape [T]"),
    (torch.ones(T, dtype=torch.bool, device="meta"), ValueError, "move them together"),
])
def test_bad_row_masks_are_refused_and_inputs_untouched(bad, error, words):
    h, w, tokens, _, _, _ = _inputs()
    logits = h @ w.t()
    before = logits.clone()
    for call in (lambda: log_probs_and_entropy(logits, tokens, row_mask=bad),
                 lambda: lm_head_log_probs_and_entropy(h, w, tokens, row_mask=bad),
                 lambda: topk_ids(logits, K, row_mask=bad)):
        with pytest.raises(error, match="row_mask") as info:
            call()
        assert words in str(info.value)
    assert torch.equal(logits, before)
