"""Union token sets: `union_ids` and padded ids with `ids_mask` on the logits and the fused routes,
against a float64 dense computation (ops/topk.py, ops/lm_head.py)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import lm_head_topk_logprobs, topk_ids, topk_kl, topk_logprobs, topk_opd_loss, union_ids
from megatron_rl_patches.ops._divergences import DIVERGENCES
from megatron_rl_patches.testing.divergence_reference import reference_divergence

INF = float("inf")
T, V, H, K = 10, 90, 12, 5


def dense_buckets(z: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 (k+1) log-buckets [T, k+1] of logits z: log p at the real ids (-inf at padding) and
    the log mass of every other column, summed densely in probability space."""
    p = torch.softmax(z.double(), dim=-1)
    at = p.gather(-1, ids.clamp_min(0)).masked_fill(~mask, 0.0)
    tail = 1 - at.sum(-1)
    return torch.cat([at, tail[:, None]], dim=-1).log()


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.6
    teacher_logits = torch.randn(3, T, V, generator=gen, dtype=torch.float64) * 2
    student_ids = topk_ids((hidden @ weight.T).float(), K)
    ids, mask = union_ids(student_ids, topk_ids(teacher_logits[0].float(), K))
    return hidden, weight, teacher_logits, ids, mask, gen


# ----------------------------------------------------------------------------- union_ids
def test_union_ids_is_the_set_union_student_first():
    gen = torch.Generator().manual_seed(1)
    student = torch.stack([torch.randperm(12, generator=gen)[:4] for _ in range(50)]).int()
    teacher = torch.stack([torch.randperm(12, generator=gen)[:3] for _ in range(50)])
    ids, mask = union_ids(student, teacher)
    assert ids.shape == mask.shape == (50, 7) and ids.dtype == torch.long and mask.dtype == torch.bool
    for row in range(50):
        s, t = student[row].tolist(), teacher[row].tolist()
        want = s + [i for i in t if i not in s]
        n = len(want)
        assert ids[row, :n].tolist() == want and mask[row, :n].all() and not mask[row, n:].any()
        assert (ids[row, n:] == -1).all()
    assert bool(mask.sum(-1).ge(4).all()) and bool(mask.sum(-1).lt(7).any())


def test_union_ids_keeps_leading_dims_and_names_bad_input():
    ids, mask = union_ids(torch.tensor([[[1, 2]], [[3, 4]]]), torch.tensor([[[2, 5]], [[6, 7]]]))
    assert ids.tolist() == [[[1, 2, 5, -1]], [[3, 4, 6, 7]]] and mask.shape == (2, 1, 4)
    with pytest.raises(ValueError, match="leading dims"):
        union_ids(torch.zeros(3, 2, dtype=torch.long), torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="teacher_ids"):
        union_ids(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2))


# ----------------------------------------------------------------------------- masked log-probs
def _masked_outputs(route, sources, ids, mask, g_lp, g_tail, dense=False):
    """(buckets [T, k+1], gradients of the sources) of Σ g·logp + Σ g_tail·tail, by the op or densely."""
    leaves = [t.detach().clone().requires_grad_(True) for t in sources]
    if dense:
        z = leaves[0] if route == "logits" else leaves[0] @ leaves[1].T
        out = dense_buckets(z, ids, mask)
        lp, tail = out[:, :-1], out[:, -1]
    elif route == "logits":
        lp, tail = topk_logprobs(leaves[0], ids, ids_mask=mask, chunk_size=3)
    else:
        lp, tail = lm_head_topk_logprobs(*leaves, ids, ids_mask=mask, chunk_size=3)
    ((lp.masked_fill(~mask, 0) * g_lp.to(lp.dtype)).sum() + (tail * g_tail.to(tail.dtype)).sum()).backward()
    return torch.cat([lp, tail[:, None]], -1).detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("route", ["logits", "fused"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_masked_logprobs_match_dense_float64(route, dtype):
    hidden, weight, _, ids, mask, gen = inputs(2)
    assert bool((~mask).any())
    garbage = torch.where(mask, ids, torch.randint(-5, 3 * V, ids.shape, generator=gen))  # padding: any value
    g_lp, g_tail = torch.randn(T, ids.size(1), generator=gen), torch.randn(T, generator=gen)
    sources = [hidden.to(dtype), weight.to(dtype)]
    if route == "logits":
        sources = [sources[0] @ sources[1].T]
    ref, ref_grads = _masked_outputs(route, [t.double() for t in sources], ids, mask, g_lp, g_tail, dense=True)
    value_tol, grad_tol = (1e-9, 1e-9) if dtype == torch.float64 else (1e-5, 1e-4)
    for padded in (ids, garbage):
        got, grads = _masked_outputs(route, sources, padded, mask, g_lp, g_tail)
        assert got.dtype == dtype and torch.equal(torch.isneginf(got), torch.isneginf(ref))
        assert bool(torch.isneginf(got[:, :-1][~mask]).all())
        fin = torch.isfinite(ref)
        assert bool(((got[fin].double() - ref[fin]).abs() <= value_tol * ref[fin].abs().clamp_min(1)).all())
        for grad, want in zip(grads, ref_grads):
            assert (grad.double() - want).abs().max().item() <= grad_tol * want.abs().max().item()


def test_padded_slots_are_owned_by_no_id_and_all_padding_is_the_whole_tail():
    x = torch.randn(3, 20, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[4, 4, 7], [0, 1, 2], [5, 6, 7]])  # row 0: the second 4 is padding, not a repeat
    mask = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])
    lp, tail = topk_logprobs(x, ids, ids_mask=mask)
    full = torch.log_softmax(x.detach(), -1)
    torch.testing.assert_close(lp[0, [0, 2]], full[0, [4, 7]])
    assert tail[1].item() == 0.0 and bool(torch.isneginf(lp[1]).all())  # nothing marked: the tail is everything
    lp.masked_fill(~mask, 0).sum().backward()
    assert bool(torch.isfinite(x.grad).all()) and bool((x.grad[1] == 0).all())
    masked_grad, x.grad = x.grad, None
    lp, _ = topk_logprobs(x, ids, ids_mask=mask)
    lp.backward(torch.ones_like(lp))  # a gradient arriving at the padding is dropped: -inf is a constant
    assert torch.equal(x.grad, masked_grad)


# ----------------------------------------------------------------------------- the loss on union buckets
def _dense_loss(z, ids, mask, teacher_logits, weights, name, beta, alpha):
    p = dense_buckets(z, ids, mask).exp()
    qs = torch.stack([dense_buckets(t, ids, mask).exp() for t in teacher_logits])
    w = torch.tensor(weights, dtype=torch.float64)
    return reference_divergence(name, p.log(), ((w[:, None, None] * qs).sum(0) / w.sum()).log(), beta, alpha)


@pytest.mark.parametrize("route", ["logits", "fused"])
@pytest.mark.parametrize("name", DIVERGENCES)
def test_union_loss_matches_dense_float64_three_teachers(route, name):
    hidden, weight, teacher_logits, ids, mask, _ = inputs(3)
    weights = [0.5, 0.3, 0.2]
    with torch.no_grad():  # the teachers' pass at the union ids (teacher 0 chose half of them)
        scored = [topk_logprobs(t, ids, ids_mask=mask) for t in teacher_logits]
    tlp, ttail = torch.stack([s[0] for s in scored]), torch.stack([s[1] for s in scored])
    tlp = tlp.masked_fill(~mask, 0.0)  # what a remote teacher might put in padded slots: ignored
    options = dict(divergence=name, beta=0.3, alpha=0.2, teacher_weights=weights, ids_mask=mask)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    if route == "logits":
        loss = topk_opd_loss(h @ w.T, ids, tlp, ttail, chunk_size=4, **options)
    else:
        loss = topk_kl(*lm_head_topk_logprobs(h, w, ids, ids_mask=mask, chunk_size=4), tlp, ttail, **options)
    loss.sum().backward()
    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = _dense_loss(h_ref @ w_ref.T, ids, mask, teacher_logits, weights, name, 0.3, 0.2)
    ref.sum().backward()
    assert bool(((loss - ref).abs() <= 1e-9 * (1 + ref.abs())).all())
    for got, want in ((h.grad, h_ref.grad), (w.grad, w_ref.grad)):
        assert (got - want).abs().max().item() <= 1e-9 * want.abs().max().item()


def test_union_buckets_bound_both_single_sets():
    """More buckets, a finer coarsening: the union's reverse KL is at least each set's."""
    hidden, weight, teacher_logits, ids, mask, _ = inputs(4)
    z = hidden @ weight.T
    union = _dense_loss(z, ids, mask, teacher_logits[:1], [1.0], "reverse_kl", 0.5, 0.1)
    with torch.no_grad():
        tlp, ttail = topk_logprobs(teacher_logits[0], ids, ids_mask=mask)
        got = topk_opd_loss(z, ids, tlp, ttail, ids_mask=mask)
        for subset in (ids[:, :K], topk_ids(teacher_logits[0], K)):
            single = topk_opd_loss(z, subset, *topk_logprobs(teacher_logits[0], subset))
            assert bool((got >= single - 1e-12).all())
    torch.testing.assert_close(got, union, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- bad masks
@pytest.mark.parametrize("bad,error,match", [
    (lambda m: m.int(), TypeError, "ids_mask must be a bool tensor"),
    (lambda m: m[:, :-1], ValueError, "ids_mask must have"),
    (lambda m: m.tolist(), TypeError, "ids_mask must be a bool tensor"),
])
def test_bad_ids_mask_is_named_and_changes_nothing(bad, error, match):
    hidden, weight, teacher_logits, ids, mask, _ = inputs(5)
    x = (hidden @ weight.T).requires_grad_(True)
    before = (x.detach().clone(), ids.clone(), mask.clone())
    tlp, ttail = topk_logprobs(teacher_logits[0], ids, ids_mask=mask)
    for call in (lambda: topk_logprobs(x, ids, ids_mask=bad(mask)),
                 lambda: lm_head_topk_logprobs(hidden, weight, ids, ids_mask=bad(mask)),
                 lambda: topk_opd_loss(x, ids, tlp, ttail, ids_mask=bad(mask)),
                 lambda: topk_kl(tlp, ttail, tlp, ttail, ids_mask=bad(mask))):
        with pytest.raises(error, match=match):
            call()
    assert torch.equal(before[0], x.detach()) and torch.equal(before[1], ids) and torch.equal(before[2], mask)
    assert x.grad is None


def test_padding_without_its_mask_is_an_error():
    _, _, teacher_logits, ids, mask, _ = inputs(6)
    with pytest.raises(ValueError, match=r"ids must be global vocab ids in \[0, 90\), found -1"):
        topk_logprobs(teacher_logits[0], ids)
    with pytest.raises(ValueError, match="must not repeat"):  # a real id twice is still refused
        topk_logprobs(teacher_logits[0], ids[:, [0, 0, 1]], ids_mask=torch.ones(T, 3, dtype=torch.bool))
