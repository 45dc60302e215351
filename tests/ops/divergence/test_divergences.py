"""The divergence family on the top-k + tail buckets (ops/_divergences.py, topk_kl / topk_opd_loss)
against a float64 dense computation on the (k+1) buckets in probability space."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_rl_patches import topk_ids, topk_kl, topk_logprobs, topk_opd_loss
from megatron_rl_patches.ops import _divergences
from megatron_rl_patches.ops._divergences import DIVERGENCES, check_divergence
from megatron_rl_patches.testing.divergence_reference import bucket_loss, reference_divergence

INF = float("inf")
T, V, K = 9, 120, 6


# ----------------------------------------------------------------------------- float64 reference
def ref_loss(logits, ids, teacher_lp, teacher_tail, weights, name, beta, alpha, renormalize=False):
    """float64 loss and logits' gradient from the one reference (testing/divergence_reference.py)."""
    return bucket_loss(logits, ids, teacher_lp, teacher_tail, divergence=name, beta=beta, alpha=alpha,
                       teacher_weights=weights, renormalize=renormalize)


def teachers_at(ids, n, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(n, T, V, generator=gen, dtype=torch.float64) * 2, dim=-1)
    at = logp.gather(-1, ids.expand(n, T, ids.size(-1)))
    keep = torch.ones_like(logp, dtype=torch.bool).scatter(-1, ids.expand(n, T, ids.size(-1)), False)
    return at.to(dtype), torch.logsumexp(logp.masked_fill(~keep, -INF), dim=-1).to(dtype)


def assert_matches(loss, grad, ref, ref_grad, dtype):
    err = (loss.double() - ref).abs()
    if dtype == torch.float64:
        assert bool((err <= 1e-9 * (1 + ref.abs())).all()), f"max value error {err.max().item():.3e}"
        grad_tol = 1e-9
    else:
        assert bool((err <= 1e-5 * ref.abs().clamp_min(1)).all()), f"max value error {err.max().item():.3e}"
        grad_tol = 1e-4
    scale = ref_grad.abs().max().item()
    gerr = (grad.double() - ref_grad).abs().max().item()
    assert gerr <= grad_tol * scale, f"gradient error {gerr:.3e} > {grad_tol} x {scale:.3e}"


SETTINGS = [(name, 0.5, 0.1) for name in DIVERGENCES] + [
    ("jsd", 0.0, 0.1), ("jsd", 1.0, 0.1), ("jsd", 0.9, 0.1),
    ("skew_forward_kl", 0.5, 0.0), ("skew_reverse_kl", 0.5, 0.0), ("skew_reverse_kl", 0.5, 0.7),
    ("mixed_kl", 0.0, 0.1), ("mixed_kl", 1.0, 0.1), ("mixed_kl", 0.2, 0.1),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("weights", [[1.0], [0.2, 1.0, 3.0]])
@pytest.mark.parametrize("name,beta,alpha", SETTINGS)
def test_bucket_divergences_match_float64_reference(name, beta, alpha, weights, dtype):
    gen = torch.Generator().manual_seed(3 + len(weights))
    logits = torch.randn(T, V, generator=gen, dtype=torch.float64).mul(2).to(dtype)
    ids = topk_ids(logits, K)
    tlp, ttail = teachers_at(ids, len(weights), seed=17, dtype=dtype)
    ref, ref_grad = ref_loss(logits, ids, tlp, ttail, weights, name, beta, alpha)
    options = dict(divergence=name, beta=beta, alpha=alpha, teacher_weights=weights)
    teachers = (tlp[0], ttail[0]) if len(weights) == 1 else (tlp, ttail)

    x = logits.clone().requires_grad_(True)
    loss = topk_opd_loss(x, ids, *teachers, chunk_size=4, **options)
    loss.sum().backward()
    assert loss.shape == (T,) and loss.dtype == dtype
    assert_matches(loss, x.grad, ref, ref_grad, dtype)

    x = logits.clone().requires_grad_(True)
    t_lp, t_tail = (t.clone().requires_grad_(True) for t in teachers)
    split = topk_kl(*topk_logprobs(x, ids), t_lp, t_tail, **options)
    split.sum().backward()
    assert_matches(split, x.grad, ref, ref_grad, dtype)
    assert t_lp.grad is None and t_tail.grad is None  # teachers get no gradient


@pytest.mark.parametrize("name,beta,alpha,plain", [
    ("jsd", 0.0, 0.1, "forward_kl"), ("jsd", 1.0, 0.1, "reverse_kl"),
    ("skew_forward_kl", 0.5, 0.0, "forward_kl"), ("skew_reverse_kl", 0.5, 0.0, "reverse_kl"),
])
def test_edge_values_are_the_plain_kls_bitwise(name, beta, alpha, plain):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(T, V, generator=gen) * 2
    ids = topk_ids(logits, K)
    tlp, ttail = teachers_at(ids, 2, seed=5, dtype=torch.float32)
    edge = topk_opd_loss(logits, ids, tlp, ttail, divergence=name, beta=beta, alpha=alpha)
    assert torch.equal(edge, topk_opd_loss(logits, ids, tlp, ttail, divergence=plain))


def test_jsd_and_skews_approach_their_limits():
    """Inside the range the formulas are continuous: skew α -> 0 is the plain KL; jsd β -> 1 is
    (1 − β)-weighted and tends to 0 (the endpoints are conventions, not limits)."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(T, V, generator=gen, dtype=torch.float64)
    ids = topk_ids(logits, K)
    tlp, ttail = teachers_at(ids, 1, seed=7, dtype=torch.float64)
    loss = lambda **kw: topk_opd_loss(logits, ids, tlp[0], ttail[0], **kw)  # noqa: E731
    torch.testing.assert_close(loss(divergence="skew_forward_kl", alpha=1e-9), loss(divergence="forward_kl"))
    assert loss(divergence="jsd", beta=1 - 1e-9).abs().max().item() < 1e-8
    assert bool((loss(divergence="tv") <= 1).all()) and bool((loss(divergence="jsd") <= math.log(2)).all())


# ----------------------------------------------------------------------------- zero-probability buckets
@pytest.mark.parametrize("name", DIVERGENCES)
def test_neg_inf_buckets_give_no_nan_values_or_gradients(name):
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 30, generator=gen, dtype=torch.float64)
    logits[0, 3] = -INF  # the student's bucket at id 3 of row 0 has probability 0
    ids = torch.tensor([[3, 4, 5]] * 4)
    tlp = torch.log_softmax(torch.randn(2, 4, 30, generator=gen, dtype=torch.float64), -1).gather(
        -1, ids.expand(2, 4, 3))
    ttail = torch.log1p(-tlp.exp().sum(-1))
    tlp[:, 1, 0] = -INF  # both teachers 0 on a bucket where the student is not
    tlp[:, 2, 1] = -INF
    x = logits.clone().requires_grad_(True)
    loss = topk_opd_loss(x, ids, tlp, ttail, divergence=name, teacher_weights=[0.5, 0.5])
    assert not bool(torch.isnan(loss).any())
    finite = torch.isfinite(loss)
    loss[finite].sum().backward()
    assert not bool(torch.isnan(x.grad).any())
    # rows with no bucket where only the teacher has mass equal the reference
    p = torch.softmax(x.detach(), -1).gather(-1, ids)
    p = torch.cat([p, 1 - p.sum(-1, keepdim=True)], -1)
    q = (0.5 * torch.cat([tlp.exp(), ttail.exp()[..., None]], -1)).sum(0)
    ref = reference_divergence(name, p.log(), q.log(), 0.5, 0.1)
    assert torch.equal(torch.isfinite(ref), finite)
    torch.testing.assert_close(loss[finite].detach(), ref[finite], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ops", ["SAFE", "FINITE"])
@pytest.mark.parametrize("name,beta,alpha", SETTINGS)
def test_table_gradient_terms_are_the_autograd_gradient(name, beta, alpha, ops):
    """The table's g (what the tile route uses: dD/dz = g − p·Σg) equals autograd through the
    table's own terms (what the bucket route uses), and the row constant shortcuts hold."""
    gen = torch.Generator().manual_seed(9)
    z = torch.randn(6, 7, generator=gen, dtype=torch.float64)
    log_t = torch.randn(6, 7, generator=gen, dtype=torch.float64)
    if ops == "SAFE":  # a masked id (the tile route's keep_mask): zero for both models
        z[0, 2] = log_t[0, 2] = -INF
    log_t = torch.log_softmax(log_t, -1)
    z.requires_grad_(True)
    log_s = torch.log_softmax(z, -1)
    plan = _divergences.ResolvedDivergence.of(name, beta, alpha)
    value = _divergences.sum_parts(plan.parts(_divergences.Entries(log_s, log_t, _divergences.SAFE)))
    value.sum().backward()
    with torch.no_grad():
        g = plan.grad_terms(_divergences.Entries(log_s, log_t, getattr(_divergences, ops)))
        expected = g - log_s.exp() * g.sum(-1, keepdim=True)
        constant = {"zero": torch.zeros(6, dtype=torch.float64), "value": value, "sum": g.sum(-1)}[plan.row.constant]
    torch.testing.assert_close(z.grad, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g.sum(-1), constant, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(value, reference_divergence(name, log_s.detach(), log_t, beta, alpha),
                               rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- arguments
def _inputs():
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(T, V, generator=gen)
    ids = topk_ids(logits, K)
    tlp, ttail = teachers_at(ids, 2, seed=11, dtype=torch.float32)
    return logits, ids, tlp, ttail


@pytest.mark.parametrize("kl,mix,expected", [
    ("reverse", None, [0.0]), ("forward", None, [1.0]), ("mixed", 0.3, [0.3]), ("mixed", None, [0.5]),
    (None, 0.25, [0.0]),  # mix alone: today's default kl="reverse"
])
def test_deprecated_kl_and_mix_map_onto_the_family(kl, mix, expected):
    logits, ids, tlp, ttail = _inputs()
    with pytest.warns(DeprecationWarning, match="divergence="):
        old = topk_opd_loss(logits, ids, tlp, ttail, kl=kl, mix=mix)
    with pytest.warns(DeprecationWarning, match="divergence="):
        split = topk_kl(*topk_logprobs(logits, ids), tlp, ttail, kl=kl, mix=mix)
    fwd = topk_opd_loss(logits, ids, tlp, ttail, divergence="forward_kl")
    rev = topk_opd_loss(logits, ids, tlp, ttail, divergence="reverse_kl")
    m = expected[0]
    want = fwd if m == 1.0 else rev if m == 0.0 else m * fwd + (1 - m) * rev
    torch.testing.assert_close(old, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split, old)
    current = topk_opd_loss(logits, ids, tlp, ttail, divergence="mixed_kl", beta=1 - m)
    assert torch.equal(old, current)  # kl="mixed", mix=m is the mixed_kl row with β = 1 − m


def test_default_is_reverse_kl_without_warning():
    logits, ids, tlp, ttail = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = topk_opd_loss(logits, ids, tlp, ttail)
        assert torch.equal(default, topk_opd_loss(logits, ids, tlp, ttail, divergence="reverse_kl"))
        assert torch.equal(topk_kl(*topk_logprobs(logits, ids), tlp, ttail), default)


@pytest.mark.parametrize("legacy", [{"kl": "reverse"}, {"mix": 0.5}, {"kl": "forward", "mix": 0.2}])
def test_divergence_with_kl_or_mix_is_a_type_error(legacy):
    logits, ids, tlp, ttail = _inputs()
    for call in (lambda: topk_opd_loss(logits, ids, tlp, ttail, divergence="reverse_kl", **legacy),
                 lambda: topk_kl(*topk_logprobs(logits, ids), tlp, ttail, divergence="jsd", **legacy)):
        with pytest.raises(TypeError, match="not both"):
            call()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"divergence": "kl"}, ValueError, "unknown divergence 'kl'"),
    ({"divergence": "JSD"}, ValueError, "unknown divergence"),
    ({"divergence": 3}, TypeError, "divergence must be a str"),
    ({"divergence": "jsd", "beta": 1.5}, ValueError, r"beta must be in \[0, 1\]"),
    ({"divergence": "jsd", "beta": -0.1}, ValueError, r"beta must be in \[0, 1\]"),
    ({"divergence": "jsd", "beta": math.nan}, ValueError, "beta must be a finite float"),
    ({"divergence": "jsd", "beta": True}, TypeError, "beta must be a float"),
    ({"divergence": "skew_forward_kl", "alpha": 1.0}, ValueError, r"alpha must be in \[0, 1\)"),
    ({"divergence": "skew_reverse_kl", "alpha": -0.5}, ValueError, r"alpha must be in \[0, 1\)"),
    ({"divergence": "tv", "alpha": INF}, ValueError, "alpha must be a finite float"),
    ({"alpha": "0.1"}, TypeError, "alpha must be a float"),
    ({"kl": "jsd"}, ValueError, "kl must be one of"),
])
def test_bad_arguments_are_named_and_change_nothing(kwargs, error, match):
    logits, ids, tlp, ttail = _inputs()
    x = logits.clone().requires_grad_(True)
    before = [t.clone() for t in (logits, ids, tlp, ttail)]
    lp, tail = topk_logprobs(x, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(error, match=match):
            topk_opd_loss(x, ids, tlp, ttail, **kwargs)
        with pytest.raises(error, match=match):
            topk_kl(lp, tail, tlp, ttail, **kwargs)
    for old, new in zip(before, (x.detach(), ids, tlp, ttail)):
        assert torch.equal(old, new)
    assert x.grad is None


def test_check_divergence_returns_floats():
    assert check_divergence("jsd", 1, 0) == ("jsd", 1.0, 0.0)
    assert isinstance(check_divergence("tv")[1], float)


# ----------------------------------------------------------------------------- renormalize=
@pytest.mark.parametrize("weights", [[1.0], [0.2, 1.0, 3.0]])
@pytest.mark.parametrize("name,beta", [("mixed_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("tv", 0.5)])
def test_renormalized_buckets_match_float64_reference(name, beta, weights):
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(T, V, generator=gen, dtype=torch.float64).mul(2)
    ids = topk_ids(logits, K)
    tlp, ttail = teachers_at(ids, len(weights), seed=13, dtype=torch.float64)
    ref, ref_grad = ref_loss(logits, ids, tlp, None, weights, name, beta, 0.1, renormalize=True)
    options = dict(divergence=name, beta=beta, teacher_weights=weights, renormalize=True)
    for tails in (ttail, None):  # the tails play no part once dropped
        x = logits.clone().requires_grad_(True)
        loss = topk_opd_loss(x, ids, tlp, tails, **options)
        loss.sum().backward()
        assert_matches(loss, x.grad, ref, ref_grad, torch.float64)
        x = logits.clone().requires_grad_(True)
        split = topk_kl(*topk_logprobs(x, ids), tlp, tails, **options)
        split.sum().backward()
        assert_matches(split, x.grad, ref, ref_grad, torch.float64)
    assert (topk_opd_loss(logits, ids, tlp, ttail, divergence=name, beta=beta, teacher_weights=weights)
            - ref).abs().max() > 1e-6  # the tail changes the loss: renormalize= is not ignored


def test_nemo_rl_topk_loss_is_the_full_vocabulary_loss_over_the_kept_ids():
    """NeMo-RL's default (mixed KL, weight 0.5, renormalized over the top-k, no tail) on the bucket
    route equals lm_head_divergence with keep_mask = the same ids: one row, both routes."""
    from megatron_rl_patches import lm_head_divergence

    gen = torch.Generator().manual_seed(14)
    h, th = torch.randn(T, 8, generator=gen, dtype=torch.float64), torch.randn(T, 8, generator=gen, dtype=torch.float64)
    w, tw = torch.randn(V, 8, generator=gen, dtype=torch.float64), torch.randn(V, 8, generator=gen, dtype=torch.float64)
    x = (h @ w.T).requires_grad_(True)
    teacher = th @ tw.T
    ids = topk_ids(teacher, K)  # the teacher's top-k, as NeMo-RL picks them
    tlp, _ = topk_logprobs(teacher, ids)
    buckets = topk_opd_loss(x, ids, tlp, divergence="mixed_kl", beta=0.5, renormalize=True)
    buckets.sum().backward()
    keep = torch.zeros(T, V, dtype=torch.bool).scatter_(1, ids, True)
    hh = h.clone().requires_grad_(True)
    fused = lm_head_divergence(hh, w, th, tw, divergence="mixed_kl", beta=0.5, keep_mask=keep)
    fused.sum().backward()
    torch.testing.assert_close(buckets.detach(), fused.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad @ w, hh.grad, rtol=1e-9, atol=1e-11)  # dL/dh = dL/dx · W


def test_renormalize_with_ids_mask_ignores_padded_slots():
    logits, ids, tlp, ttail = _inputs()
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, -2:] = False
    garbage = ids.clone()
    garbage[:, -2:] = 0  # padded slots hold any id
    masked = topk_opd_loss(logits, garbage, tlp, ttail, ids_mask=mask, renormalize=True)
    kept = topk_opd_loss(logits, ids[:, :-2], tlp[..., :-2], ttail, renormalize=True)
    torch.testing.assert_close(masked, kept, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_renormalize_must_be_a_bool(bad):
    logits, ids, tlp, ttail = _inputs()
    with pytest.raises(TypeError, match="renormalize must be True"):
        topk_opd_loss(logits, ids, tlp, ttail, renormalize=bad)
    with pytest.raises(TypeError, match="renormalize must be True"):
        topk_kl(*topk_logprobs(logits, ids), tlp, ttail, renormalize=bad)


# ----------------------------------------------------------------------------- row_mask= on the fused route
@pytest.mark.parametrize("name,n", [("reverse_kl", 1), ("jsd", 2)])
def test_lm_head_divergence_row_mask_selects_rows(name, n):
    """Selected rows: the all-rows values and hidden gradients (bit for bit with the same tiles);
    unselected rows: 0, no gradient; dW as the all-rows dW with their upstream gradient 0."""
    from megatron_rl_patches import lm_head_divergence

    gen = torch.Generator().manual_seed(15)
    h, w = torch.randn(T, 8, generator=gen), torch.randn(V, 8, generator=gen)
    teachers = [(torch.randn(T, 8, generator=gen), torch.randn(V, 8, generator=gen)) for _ in range(n)]
    mask = torch.rand(T, generator=gen) < 0.5
    mask[0] = True
    upstream = torch.rand(T, generator=gen) + 0.5

    def run(row_mask, grad):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = lm_head_divergence(hh, ww, [t[0] for t in teachers], [t[1] for t in teachers], divergence=name,
                                 chunk_size=1, row_mask=row_mask)
        out.backward(grad)
        return out.detach(), hh.grad, ww.grad

    full, full_h, _ = run(None, upstream)
    _, _, zeroed_w = run(None, upstream * mask)
    sel, sel_h, sel_w = run(mask, upstream)
    assert torch.equal(sel[mask], full[mask]) and bool((sel[~mask] == 0).all())
    assert torch.equal(sel_h[mask], full_h[mask]) and bool((sel_h[~mask] == 0).all())
    torch.testing.assert_close(sel_w, zeroed_w, rtol=1e-5, atol=1e-6)
    none, none_h, none_w = run(torch.zeros(T, dtype=torch.bool), upstream)
    assert not none.any() and not none_h.any() and not none_w.any()
    with pytest.raises(TypeError, match="row_mask must be a bool tensor"):
        run(mask.long(), upstream)
