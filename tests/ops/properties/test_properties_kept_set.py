"""Property tests of `lm_head_kept_log_probs` (top-p replay's kept-set log-probs) against a float64
dense reference with slime's semantics (log p(target) − logsumexp over the kept ids and the
target): nuclei that are strict subsets of the vocabulary, empty nuclei (log-prob 0), targets
outside the set, repeated ids, rows left out by `row_mask`, per-token temperatures, gradients to
hidden and weight; bad inputs are refused by name with the inputs unchanged."""
from __future__ import annotations

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from property_kit import SETTINGS, generator

from megatron_rl_patches.ops.kept_set import lm_head_kept_log_probs


def dense_reference(hidden, weight, tokens, ids, rows, tau, row_mask=None):
    """float64 [T]: slime's keep-mask route on dense logits (the mask built [T, V] here only)."""
    z = (hidden.double() @ weight.double().T) / (tau[:, None] if isinstance(tau, torch.Tensor) else tau)
    keep = torch.zeros(z.shape, dtype=torch.bool)
    keep[rows, ids] = True
    keep[torch.arange(z.size(0)), tokens] = True
    out = z.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(z.masked_fill(~keep, -torch.inf), -1)
    return out if row_mask is None else torch.where(row_mask, out, 0.0)


@st.composite
def kept_case(draw):
    T, H, V = draw(st.integers(1, 6)), draw(st.integers(1, 5)), draw(st.integers(2, 12))
    g = generator(draw)
    scale = draw(st.sampled_from([0.3, 1.0, 4.0]))
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64) * scale
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * scale
    tokens = torch.randint(0, V, (T,), generator=g)
    ids, rows = [], []
    for r in range(T):
        size = draw(st.integers(0, V - 1))  # strict subsets, empty ones included
        kept = torch.randperm(V, generator=g)[:size].tolist()
        if draw(st.booleans()):
            kept = [i for i in kept if i != int(tokens[r])]  # the target outside the set
        if kept and draw(st.integers(0, 3)) == 0:
            kept.append(kept[0])  # a repeated id counts once
        ids += kept
        rows += [r] * len(kept)
    perm = torch.randperm(len(ids), generator=g)  # any order
    ids_t, rows_t = torch.tensor(ids, dtype=torch.long)[perm], torch.tensor(rows, dtype=torch.long)[perm]
    tau = draw(st.sampled_from([1.0, 0.7, "per-token"]))
    if tau == "per-token":
        tau = torch.rand(T, generator=g, dtype=torch.float64) + 0.5
    row_mask = None if draw(st.booleans()) else torch.rand(T, generator=g) < 0.6
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
    return hidden, weight, tokens, ids_t, rows_t, tau, row_mask, dtype


@SETTINGS
@given(kept_case(), st.sampled_from([None, 1, 3]))
def test_kept_set_log_probs_match_the_dense_float64_reference(case, chunk):
    hidden, weight, tokens, ids, rows, tau, row_mask, dtype = case
    h = hidden.to(dtype).requires_grad_()
    w = weight.to(dtype).requires_grad_()
    tau = tau.to(dtype) if isinstance(tau, torch.Tensor) else tau  # per-token τ in the inputs' dtype
    got = lm_head_kept_log_probs(h, w, tokens, ids, rows, temperature=tau, chunk_size=chunk, row_mask=row_mask)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    tau64 = tau.double() if isinstance(tau, torch.Tensor) else tau  # the rounded values the op was given
    want = dense_reference(h64, w64, tokens, ids, rows, tau64, row_mask)
    tol = 1e-12 if dtype == torch.float64 else 2e-5 * max(1.0, float(want.detach().abs().max()))
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert float((got.detach().double() - want.detach()).abs().max()) <= tol
    empty = torch.ones(tokens.numel(), dtype=torch.bool)
    empty[rows] = False
    assert bool((got[empty] == 0).all())  # only the target: log-prob 0
    event(f"rows without kept ids: {int(empty.sum())}")
    a = torch.randn(tokens.numel(), dtype=torch.float64)
    (a.to(got.dtype) * got).sum().backward()
    (a * want).sum().backward()
    for mine, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):  # bf16 gradients are rounded to bf16
        scale = max(1.0, float(ref.abs().max()))
        grad_tol = {torch.float64: 1e-11, torch.float32: 5e-5, torch.bfloat16: 1e-2}[dtype]
        assert mine.dtype == dtype and float((mine.double() - ref).abs().max()) <= grad_tol * scale


def test_a_wrong_route_fails_the_reference():
    """Negative control: the unmasked log-prob (a route ignoring the nuclei) is far from it."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(9, 3, generator=g,
                                                                                        dtype=torch.float64)
    tokens = torch.tensor([1, 2, 3, 4])
    ids, rows = torch.tensor([1, 5, 2, 6, 7]), torch.tensor([0, 0, 1, 1, 1])
    want = dense_reference(hidden, weight, tokens, ids, rows, 1.0)
    unmasked = torch.log_softmax(hidden @ weight.T, -1).gather(1, tokens[:, None])[:, 0]
    assert float((want - unmasked).abs().min()) > 1e-3
    got = lm_head_kept_log_probs(hidden, weight, tokens, ids, rows)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("change, error, words", [
    (dict(kept_ids=torch.tensor([1, 99])), ValueError, "kept_ids must be global ids in [0, 9)"),
    (dict(kept_rows=torch.tensor([0, 7])), ValueError, "kept_rows must be row indices in [0, 4)"),
    (dict(kept_ids=torch.tensor([1.0, 2.0])), TypeError, "kept_ids must be an integer tensor"),
    (dict(kept_rows=torch.tensor([0])), ValueError, "kept_ids and kept_rows must be 1-D of the same length"),
    (dict(tokens=torch.tensor([1, 2, 3, 9])), ValueError, "tokens must be global ids in [0, 9)"),
    (dict(temperature=0.0), ValueError, "temperature"),
])
def test_bad_input_is_refused_by_name_with_the_inputs_unchanged(change, error, words):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(4, 3, generator=g).requires_grad_()
    weight = torch.randn(9, 3, generator=g).requires_grad_()
    args = dict(tokens=torch.tensor([1, 2, 3, 4]), kept_ids=torch.tensor([1, 5]), kept_rows=torch.tensor([0, 2]),
                temperature=1.0)
    args.update(change)
    before = [hidden.detach().clone(), weight.detach().clone()]
    with pytest.raises(error, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        lm_head_kept_log_probs(hidden, weight, args["tokens"], args["kept_ids"], args["kept_rows"],
                               temperature=args["temperature"])
    assert torch.equal(hidden.detach(), before[0]) and torch.equal(weight.detach(), before[1])
    assert hidden.grad is None and weight.grad is None
