"""Top-k OPD math against float64 full-vocab references (ops/topk.py)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl_patches import topk_ids, topk_kl, topk_logprobs, topk_opd_loss, union_ids
from megatron_rl_patches.ops.topk import _derived_tail, log1mexp
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.divergence_reference import bucket_loss

# Tests of the deprecated kl=/mix= (and of forms reachable only through them): opted out of the
# suite-wide "the package's deprecations are errors" filter (pyproject.toml).
pytestmark = pytest.mark.filterwarnings("ignore:kl=/mix= are deprecated:DeprecationWarning")

INF = float("inf")


# ----------------------------------------------------------------------------- references
def ref_buckets(logits, ids, temperature=1.0, vocab_size=None):
    """float64 (log p at ids, log tail) from the full softmax (complement summed in probability space)."""
    z = logits.detach().double()
    if isinstance(temperature, torch.Tensor):
        z = z / temperature.double()[..., None]
    else:
        z = z / temperature
    if vocab_size is not None:
        z = z[..., :vocab_size]
    logp = torch.log_softmax(z, dim=-1)
    at_ids = logp.gather(-1, ids)
    keep = torch.ones_like(z, dtype=torch.bool).scatter(-1, ids, False)
    tail = torch.logsumexp(logp.masked_fill(~keep, -INF), dim=-1)
    return at_ids, tail


def ref_loss(student_logits, ids, teacher_lp, teacher_tail, weights, kl, mix=0.5, temperature=1.0):
    """float64 autograd reference (the one in testing/divergence_reference.py) under the
    deprecated kl= names: kl="mixed" is mixed_kl with β = 1 − mix."""
    name = {"reverse": "reverse_kl", "forward": "forward_kl", "mixed": "mixed_kl"}[kl]
    return bucket_loss(student_logits, ids, teacher_lp, teacher_tail, divergence=name, beta=1 - mix,
                       teacher_weights=weights, temperature=temperature)


def teacher_tensors(n, T, V, ids, seed, scale=2.0):
    """fp32 top-k log-probs and exact tails of `n` random teachers at `ids`."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, T, V, generator=gen, dtype=torch.float64) * scale
    logp = torch.log_softmax(logits, dim=-1)
    at_ids = logp.gather(-1, ids.expand(n, *ids.shape))
    keep = torch.ones_like(logp, dtype=torch.bool).scatter(-1, ids.expand(n, *ids.shape), False)
    tails = torch.logsumexp(logp.masked_fill(~keep, -INF), dim=-1)
    return at_ids.float(), tails.float()


def assert_close_rel(actual, expected, rel=1e-5):
    """|actual - expected| <= rel * max|expected| (the issue's tolerance)."""
    scale = expected.abs().max().item()
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= rel * max(scale, 1e-30), f"max error {err:.3e} > {rel} x {scale:.3e}"


# ----------------------------------------------------------------------------- topk_ids
def test_topk_ids_match_torch_topk_descending_with_leading_dims():
    x = torch.randn(3, 5, 200)
    ids = topk_ids(x, 7)
    assert ids.shape == (3, 5, 7) and ids.dtype == torch.long
    assert torch.equal(ids, x.topk(7, dim=-1).indices)
    vals = x.gather(-1, ids)
    assert bool((vals[..., :-1] > vals[..., 1:]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_ids_ties_broken_by_lower_id(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4, (64, 37), generator=gen).to(dtype)  # many ties, also at the cut
    ids = topk_ids(x, 5)
    # reference: stable sort of (value desc), which keeps lower ids first among equals
    ref = torch.sort(x.double(), dim=-1, descending=True, stable=True).indices[:, :5]
    assert torch.equal(ids, ref)
    assert torch.equal(topk_ids(torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0]]), 2), torch.tensor([[1, 2]]))


def test_topk_ids_skip_padded_vocab_and_carry_no_gradient():
    x = torch.randn(6, 40, requires_grad=True)
    with torch.no_grad():
        x[:, 30:] = 100.0  # padding columns with large garbage logits
    ids = topk_ids(x, 4, vocab_size=30)
    assert not ids.requires_grad and x.grad is None
    assert torch.equal(ids, x.detach()[:, :30].topk(4).indices)
    with pytest.raises(ValueError, match="k must be smaller than the vocabulary size 30"):
        topk_ids(x, 30, vocab_size=30)


# ----------------------------------------------------------------------------- topk_logprobs
@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(0, 9),
    V=st.integers(2, 70),
    data=st.data(),
    scale=st.floats(0.1, 8.0),
    chunk=st.one_of(st.none(), st.integers(1, 5)),
    tau=st.one_of(st.just(1.0), st.floats(0.3, 3.0), st.just("per-token")),
)
def test_topk_logprobs_match_float64_reference(T, V, data, scale, chunk, tau):
    k = data.draw(st.integers(1, V - 1))
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=gen) * scale
    ids = (torch.stack([torch.randperm(V, generator=gen)[:k] for _ in range(T)]) if T
           else torch.empty(0, k, dtype=torch.long))
    temperature = torch.rand(T, generator=gen) + 0.5 if tau == "per-token" else tau
    lp, tail = topk_logprobs(x, ids, temperature=temperature, chunk_size=chunk)
    ref_lp, ref_tail = ref_buckets(x, ids, temperature)
    assert lp.dtype == torch.float32 and lp.shape == (T, k) and tail.shape == (T,)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-6 * (1 + ref_lp.abs().max().item() if T else 1))
    torch.testing.assert_close(tail.double(), ref_tail, rtol=0, atol=2e-5)
    # the k + 1 buckets are a distribution
    total = torch.cat([lp, tail[:, None]], dim=1).double().exp().sum(-1)
    assert bool(((total - 1).abs() <= 1e-6).all())


def test_tail_exact_at_mass_1e8():
    gen = torch.Generator().manual_seed(2)
    T, V, k = 6, 1000, 10
    top = torch.randn(T, k, generator=gen)
    rest = torch.randn(T, V - k, generator=gen) * 0.5
    # shift the rest so that the tail mass is ~1e-8
    shift = torch.log(1e-8 * top.double().exp().sum(-1) / rest.double().exp().sum(-1)).float()
    x = torch.cat([top, rest + shift[:, None]], dim=1)
    ids = torch.arange(k).expand(T, k).contiguous()
    lp, tail = topk_logprobs(x, ids)
    _, ref_tail = ref_buckets(x, ids)
    assert bool(((ref_tail.exp() - 1e-8).abs() < 1e-9).all())
    assert (tail.double() - ref_tail).abs().max().item() < 1e-5
    # the naive fp32 tail log(1 - sum p) is NaN or off by nats here (what this test guards against)
    naive = torch.log1p(-lp.exp().sum(-1))
    assert not bool(((naive.double() - ref_tail).abs() < 1e-2).all())


def test_topk_logprobs_gradients_match_float64_autograd():
    gen = torch.Generator().manual_seed(3)
    T, V, k = 9, 120, 6
    x = (torch.randn(T, V, generator=gen) * 3).requires_grad_(True)
    ids = torch.stack([torch.randperm(V, generator=gen)[:k] for _ in range(T)])
    tau = torch.rand(T, generator=gen) + 0.5
    g_lp, g_tail = torch.randn(T, k, generator=gen), torch.randn(T, generator=gen)
    xd = x.detach().double().requires_grad_(True)
    ref_lp, ref_tail = ref_buckets(xd, ids, tau)
    # ref_buckets detaches; rebuild differentiably
    z = xd / tau.double()[:, None]
    logp = torch.log_softmax(z, -1)
    keep = torch.ones_like(z, dtype=torch.bool).scatter(-1, ids, False)
    ((logp.gather(-1, ids) * g_lp).sum()
     + (torch.logsumexp(logp.masked_fill(~keep, -INF), -1) * g_tail).sum()).backward()
    for chunk in (1, 4, None):
        x.grad = None
        lp, tail = topk_logprobs(x, ids, temperature=tau, chunk_size=chunk)
        ((lp * g_lp).sum() + (tail * g_tail).sum()).backward()
        assert_close_rel(x.grad, xd.grad)
    # only the tail gets a gradient (the other output unused), and vice versa
    for use_tail in (True, False):
        x.grad, xd.grad = None, None
        lp, tail = topk_logprobs(x, ids)
        (tail.sum() if use_tail else lp.sum()).backward()
        lp_ref = torch.log_softmax(xd, -1)
        ref = torch.logsumexp(lp_ref.masked_fill(~keep, -INF), -1).sum() if use_tail else lp_ref.gather(-1, ids).sum()
        ref.backward()
        assert_close_rel(x.grad, xd.grad)


@layouts.mark("bf16")
def test_topk_logprobs_bf16_logits_and_padded_vocab():
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 64, generator=gen) * 4).to(torch.bfloat16).requires_grad_(True)
    with torch.no_grad():
        x[:, 50:] = 60.0  # padding garbage must not count
    ids = topk_ids(x, 4, vocab_size=50)
    lp, tail = topk_logprobs(x, ids, vocab_size=50)
    ref_lp, ref_tail = ref_buckets(x, ids, vocab_size=50)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(tail.double(), ref_tail, rtol=0, atol=1e-5)
    (lp.sum() + tail.sum()).backward()
    assert x.grad.dtype == torch.bfloat16
    assert bool((x.grad[:, 50:] == 0).all())


def test_empty_tail_and_masked_ids_give_no_nan():
    x = torch.tensor([[2.0, 1.0, 0.5, -INF, -INF, -INF], [0.0, -INF, 1.0, 3.0, 2.0, 1.0]], requires_grad=True)
    ids = torch.tensor([[0, 1, 2], [1, 3, 4]])  # row 0: complement all -inf; row 1: id 1 masked
    lp, tail = topk_logprobs(x, ids)
    assert tail[0].item() == -INF and lp[1, 0].item() == -INF
    (lp.masked_fill(torch.isinf(lp), 0).sum() + tail.masked_fill(torch.isinf(tail), 0).sum()).backward()
    assert bool(torch.isfinite(x.grad).all())
    torch.testing.assert_close(lp[0].exp().sum(), torch.tensor(1.0))


# ----------------------------------------------------------------------------- topk_opd_loss
CASES = [
    (kl, n, weights, derived)
    for kl in ("reverse", "forward", "mixed")
    for n, weights in ((1, None), (1, [2.5]), (3, None), (3, [0.2, 1.0, 3.0]))
    for derived in (False, True)
]


@pytest.mark.parametrize("kl,n,weights,derived", CASES)
def test_loss_and_grads_match_float64_reference(kl, n, weights, derived):
    gen = torch.Generator().manual_seed(5 + n)
    T, V, k = 10, 150, 8
    x = (torch.randn(T, V, generator=gen) * 2).requires_grad_(True)
    ids = topk_ids(x, k)
    tlp, ttail = teacher_tensors(n, T, V, ids, seed=11)
    if n == 1:
        tlp, ttail = tlp[0], ttail[0]
    tail_arg = None if derived else ttail
    loss = topk_opd_loss(x, ids, tlp, tail_arg, teacher_weights=weights, kl=kl, mix=0.3, chunk_size=4)
    loss.sum().backward()
    ref, ref_grad = ref_loss(x, ids, tlp, tail_arg, weights, kl, mix=0.3)
    assert loss.shape == (T,) and loss.dtype == torch.float32
    assert_close_rel(loss, ref)
    assert_close_rel(x.grad, ref_grad)


@layouts.mark("bf16")
def test_loss_on_bf16_logits_matches_float64_of_the_same_logits():
    """bf16 student logits: the loss in fp32 and the gradient in the logits' dtype equal the float64
    reference on the same (bf16-valued) logits, to fp32 and bf16 rounding."""
    gen = torch.Generator().manual_seed(8)
    T, V, k = 9, 120, 6
    x = (torch.randn(T, V, generator=gen) * 2).to(torch.bfloat16).requires_grad_(True)
    ids = topk_ids(x, k)
    tlp, ttail = teacher_tensors(2, T, V, ids, seed=13)
    loss = topk_opd_loss(x, ids, tlp, ttail, kl="mixed", mix=0.3)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    ref, ref_grad = ref_loss(x.detach().float(), ids, tlp, ttail, None, "mixed", mix=0.3)
    assert_close_rel(loss, ref)
    assert_close_rel(x.grad, ref_grad, rel=1e-2)  # the gradient rounded to bf16
    other, _ = ref_loss(x.detach().float(), ids, tlp, ttail, None, "mixed", mix=0.6)
    with pytest.raises(AssertionError):  # the check sees another mix
        assert_close_rel(loss, other)


def test_per_token_temperature_in_loss():
    gen = torch.Generator().manual_seed(6)
    T, V, k = 7, 90, 5
    x = (torch.randn(T, V, generator=gen) * 2).requires_grad_(True)
    tau = torch.rand(T, generator=gen) + 0.5
    ids = topk_ids(x, k)
    tlp, ttail = teacher_tensors(2, T, V, ids, seed=12)
    loss = topk_opd_loss(x, ids, tlp, ttail, kl="mixed", mix=0.7, temperature=tau)
    loss.sum().backward()
    ref, ref_grad = ref_loss(x, ids, tlp, ttail, None, "mixed", mix=0.7, temperature=tau)
    assert_close_rel(loss, ref)
    assert_close_rel(x.grad, ref_grad)


def test_full_vocab_limit_k_equals_v_minus_1():
    gen = torch.Generator().manual_seed(7)
    T, V = 8, 40
    x = (torch.randn(T, V, generator=gen) * 2).requires_grad_(True)
    teacher = torch.randn(T, V, generator=gen) * 2
    ids = topk_ids(x, V - 1)
    with torch.no_grad():
        tlp, ttail = topk_logprobs(teacher, ids)
    full = torch.nn.functional.kl_div(
        torch.log_softmax(teacher.double(), -1), torch.log_softmax(x.detach().double(), -1), log_target=True,
        reduction="none"
    ).sum(-1)
    for tail_arg in (ttail, None):
        loss = topk_opd_loss(x, ids, tlp, tail_arg)
        assert (loss.double() - full).abs().max().item() < 1e-5


def test_uniform_weights_equal_mixture_formula():
    gen = torch.Generator().manual_seed(8)
    T, V, k = 6, 80, 5
    x = torch.randn(T, V, generator=gen) * 2
    ids = topk_ids(x, k)
    tlp, ttail = teacher_tensors(3, T, V, ids, seed=13)
    # the mixture as one teacher: log of the mean probability per bucket
    mixed_lp = torch.logsumexp(tlp.double(), 0) - math.log(3)
    mixed_tail = torch.logsumexp(ttail.double(), 0) - math.log(3)
    single = topk_opd_loss(x, ids, mixed_lp.float(), mixed_tail.float(), kl="mixed")
    for weights in (None, [1.0, 1.0, 1.0], torch.tensor([4.0, 4.0, 4.0])):
        loss = topk_opd_loss(x, ids, tlp, ttail, teacher_weights=weights, kl="mixed")
        torch.testing.assert_close(loss, single, rtol=0, atol=1e-6)
    # a zero weight is the same as leaving that teacher out
    zero = topk_opd_loss(x, ids, tlp, ttail, teacher_weights=[1.0, 0.0, 2.0])
    dropped = topk_opd_loss(x, ids, tlp[[0, 2]], ttail[[0, 2]], teacher_weights=[1.0, 2.0])
    torch.testing.assert_close(zero, dropped, rtol=0, atol=1e-6)
    # the mixture is not the average of per-teacher losses
    per_teacher = torch.stack([topk_opd_loss(x, ids, tlp[j], ttail[j]) for j in range(3)]).mean(0)
    assert (per_teacher - topk_opd_loss(x, ids, tlp, ttail)).abs().max() > 1e-3


def test_derived_tail_stable_and_floored():
    x = torch.tensor([-1e-10, -1e-3, -0.5, -0.7, -5.0, -50.0, -800.0], dtype=torch.float64)
    exact = torch.log(-torch.expm1(x))  # fp64 reference; the float32 path below must keep its precision
    got = log1mexp(x.float()).double()
    assert bool(((got - exact).abs() <= 1e-6 * exact.abs().clamp(min=1)).all())
    # derived from top-k log-probs: equal to log(1 - sum q) when that is well conditioned
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.3, 0.3999]]))
    torch.testing.assert_close(_derived_tail(lp, lp.dtype), torch.log(torch.tensor([0.2, 1e-4])), rtol=1e-4, atol=0)
    # rounding can make the top-k sum reach or exceed 1: the tail is floored at eps, never NaN
    over = torch.log(torch.tensor([[0.6, 0.40001], [0.5, 0.5]]))
    floor = math.log(torch.finfo(torch.float32).eps)
    torch.testing.assert_close(_derived_tail(over, over.dtype), torch.full((2,), floor))
    assert _derived_tail(over.bfloat16().float(), torch.bfloat16)[0].item() == pytest.approx(math.log(2**-7))
    # all teacher log-probs -inf (masked ids): all mass in the tail
    assert _derived_tail(torch.full((1, 3), -INF), torch.float32).item() == 0.0
    x = torch.randn(2, 30, requires_grad=True)
    ids = topk_ids(x, 2)
    loss = topk_opd_loss(x, ids, over)
    assert bool(torch.isfinite(loss).all())


def test_zero_probability_buckets():
    gen = torch.Generator().manual_seed(9)
    T, V, k = 4, 30, 4
    x = torch.randn(T, V, generator=gen)
    x[0, 3] = -INF  # masked student column, chosen as an id below
    x = x.requires_grad_(True)
    ids = torch.stack([torch.randperm(V, generator=gen)[:k] for _ in range(T)])
    ids[0, 0] = 3
    tlp, ttail = teacher_tensors(1, T, V, ids, seed=14)
    tlp, ttail = tlp[0].clone(), ttail[0]
    tlp[0, 0] = -INF  # both sides zero: 0 log 0 = 0, finite, and the bucket is simply absent
    for kl in ("reverse", "forward", "mixed"):
        x.grad = None
        loss = topk_opd_loss(x, ids, tlp, ttail, kl=kl)
        loss.sum().backward()
        assert bool(torch.isfinite(loss).all()) and bool(torch.isfinite(x.grad).all())
        ref, ref_grad = ref_loss(x, ids, tlp, ttail, None, kl)
        ref = torch.nan_to_num(ref)  # reference has 0 * log 0 = nan in that bucket
        assert_close_rel(loss[1:], ref[1:])

    # teacher gives zero where the student does not: reverse KL +inf on that token only
    tlp2 = tlp.clone()
    tlp2[1, 2] = -INF
    x.grad = None
    rev = topk_opd_loss(x, ids, tlp2, ttail, kl="reverse")
    assert rev[1].item() == INF and bool(torch.isfinite(rev[[0, 2, 3]]).all())
    assert bool(torch.isfinite(topk_opd_loss(x, ids, tlp2, ttail, kl="forward")).all())
    assert topk_opd_loss(x, ids, tlp2, ttail, kl="mixed", mix=0.5)[1].item() == INF
    assert bool(torch.isfinite(topk_opd_loss(x, ids, tlp2, ttail, kl="mixed", mix=1.0)).all())
    # masking the infinite token with where() leaves finite gradients equal to dropping it
    torch.where(torch.isfinite(rev), rev, 0.0).sum().backward()
    grad_masked = x.grad.clone()
    x.grad = None
    topk_opd_loss(x, ids, tlp2, ttail, kl="reverse")[[0, 2, 3]].sum().backward()
    assert bool(torch.isfinite(grad_masked).all())
    torch.testing.assert_close(grad_masked, x.grad)

    # student gives zero where the teacher does not: forward KL +inf
    tlp3 = tlp.clone()
    tlp3[0, 0] = -1.0
    assert topk_opd_loss(x, ids, tlp3, ttail, kl="forward")[0].item() == INF
    assert math.isfinite(topk_opd_loss(x, ids, tlp3, ttail, kl="reverse")[0].item())


def test_gradient_only_to_student():
    x = torch.randn(5, 40, requires_grad=True)
    ids = topk_ids(x, 3)
    tlp, ttail = teacher_tensors(2, 5, 40, ids, seed=15)
    tlp.requires_grad_(True)
    ttail.requires_grad_(True)
    topk_opd_loss(x, ids, tlp, ttail).sum().backward()
    assert x.grad is not None and tlp.grad is None and ttail.grad is None


def test_nothing_vocab_sized_saved_for_backward():
    T, V, k = 16, 2048, 8
    x = torch.randn(T, V, requires_grad=True)
    logits = x * 1.0  # a non-leaf, as model outputs are
    ids = topk_ids(logits, k)
    tlp, _ = teacher_tensors(3, T, V, ids, seed=16)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = topk_opd_loss(logits, ids, tlp, None, kl="mixed", teacher_weights=[1, 2, 3], chunk_size=5)
    big = [t for t in saved if t.numel() >= T * V // 16]
    assert big, "the logits themselves must be saved (backward recomputes the softmax from them)"
    assert all(t.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr() for t in big)
    big_ids = {id(t) for t in big}
    assert max(t.numel() for t in saved if id(t) not in big_ids) <= T * (k + 1)
    loss.sum().backward()
    assert x.grad.shape == (T, V)


def test_per_token_layouts_leading_dims_zigzag_and_cp_shards():
    gen = torch.Generator().manual_seed(10)
    B, S, V, k = 2, 8, 50, 4
    x = torch.randn(B, S, V, generator=gen) * 2
    ids = topk_ids(x, k)
    tlp, ttail = teacher_tensors(2, B * S, V, ids.reshape(-1, k), seed=17)
    flat = topk_opd_loss(x.reshape(-1, V), ids.reshape(-1, k), tlp, ttail, kl="mixed")
    shaped = topk_opd_loss(x, ids, tlp.reshape(2, B, S, k), ttail.reshape(2, B, S), kl="mixed")
    assert shaped.shape == (B, S)
    torch.testing.assert_close(shaped.reshape(-1), flat)
    # CP zigzag with cp=2 over one packed sequence of 16 tokens: rank r holds chunks r and 3 - r
    chunks = torch.arange(B * S).chunk(4)
    for rank in range(2):
        rows = torch.cat([chunks[rank], chunks[3 - rank]])
        local = topk_opd_loss(x.reshape(-1, V)[rows], ids.reshape(-1, k)[rows], tlp[:, rows], ttail[:, rows],
                              kl="mixed")
        torch.testing.assert_close(local, flat[rows])


# ----------------------------------------------------------------------------- bad inputs
def _bad_calls():
    x = torch.randn(4, 20)
    ids = topk_ids(x, 3)
    tlp, ttail = teacher_tensors(2, 4, 20, ids, seed=18)
    dup = ids.clone()
    dup[1, 2] = dup[1, 0]
    loss = lambda **kw: topk_opd_loss(**{"student_logits": x, "ids": ids, "teacher_logprobs": tlp, **kw})  # noqa: E731
    return x, [
        (lambda: topk_ids(x.numpy(), 3), TypeError, "logits must be a torch.Tensor"),
        (lambda: topk_ids(x.long(), 3), TypeError, "floating"),
        (lambda: topk_ids(x[0], 3), ValueError, r"logits must have shape \[T, V_local\]"),
        (lambda: topk_ids(x, 0), ValueError, "k must be a positive int"),
        (lambda: topk_ids(x, True), ValueError, "k must be a positive int"),
        (lambda: topk_ids(x, 20), ValueError, "k must be smaller than the vocabulary size 20"),
        (lambda: topk_ids(x, 3, vocab_size=21), ValueError, r"vocab_size must be in \[1, 20\]"),
        (lambda: topk_logprobs(x, ids.float()), TypeError, "ids must be an integer tensor"),
        (lambda: topk_logprobs(x, ids[:3]), ValueError, "ids must have shape"),
        (lambda: topk_logprobs(x, ids.clamp(max=-1)), ValueError, r"ids must be global vocab ids in \[0, 20\)"),
        (lambda: topk_logprobs(x, ids + 20), ValueError, r"ids must be global vocab ids in \[0, 20\)"),
        (lambda: topk_logprobs(x, ids, vocab_size=10), ValueError,
         r"ids must be global vocab ids in \[0, 10\)|smaller"),
        (lambda: topk_logprobs(x, dup), ValueError, "ids must not repeat within a row"),
        (lambda: topk_logprobs(x, torch.randperm(20).expand(4, 20)), ValueError,
         r"ids.shape\[-1\] \(k\) must be smaller"),
        (lambda: topk_logprobs(x, ids, temperature=0.0), ValueError, "temperature must be finite and > 0"),
        (lambda: topk_logprobs(x, ids, temperature=float("nan")), ValueError, "temperature must be finite and > 0"),
        (lambda: topk_logprobs(x, ids, temperature=torch.tensor([1.0, 1.0, -1.0, 1.0])), ValueError, "every token"),
        (lambda: topk_logprobs(x, ids, temperature=torch.ones(3)), ValueError, "temperature tensor must have shape"),
        (lambda: topk_logprobs(x, ids, temperature=True), TypeError, "temperature must be a float"),
        (lambda: topk_logprobs(x, ids, chunk_size=0), ValueError, "chunk_size must be a positive int"),
        (lambda: loss(kl="jsd"), ValueError, "kl must be one of"),
        (lambda: loss(mix=1.5), ValueError, r"mix must be a float in \[0, 1\]"),
        (lambda: loss(teacher_logprobs=tlp[:, :3]), ValueError, "teacher_logprobs must have shape"),
        (lambda: loss(teacher_logprobs=tlp[:0]), ValueError, "at least one teacher"),
        (lambda: loss(teacher_logprobs=tlp.tolist()), TypeError, "teacher_logprobs must be a torch.Tensor"),
        (lambda: loss(teacher_tail_logprobs=ttail[0]), ValueError, "teacher_tail_logprobs must have shape"),
        (lambda: loss(teacher_weights=[1.0, -1.0]), ValueError, "teacher_weights must be finite and >= 0"),
        (lambda: loss(teacher_weights=[0.0, 0.0]), ValueError, "teacher_weights must not all be zero"),
        (lambda: loss(teacher_weights=[1.0]), ValueError, r"teacher_weights must have shape \(2,\)"),
        (lambda: loss(teacher_weights=[1.0, float("nan")]), ValueError, "finite"),
        (lambda: loss(teacher_weights=["a", 1]), TypeError, "teacher_weights must be a sequence"),
        (lambda: loss(student_logits=x[:, None]), ValueError, "teacher_logprobs must have shape|ids must have shape"),
        # each message names the argument and its shape (mutation testing: a dropped name or hint passed)
        (lambda: topk_kl(tlp[0], ttail[0].tolist(), tlp), TypeError, r"student_tail must be a torch.Tensor \[T\],"),
        (lambda: union_ids(ids.tolist(), ids), TypeError, r"student_ids must be a torch.Tensor \[T, k\] of global"),
        (lambda: union_ids(ids, ids.tolist()), TypeError, r"teacher_ids must be a torch.Tensor \[T, k\] of global"),
        (lambda: topk_kl(tlp[0], ttail[0].double(), tlp), ValueError, "student_tail must have student_logprobs' dtype"),
        (lambda: loss(student_logits=x.numpy()), TypeError, "student_logits must be a torch.Tensor"),
    ]


def test_topk_opd_loss_row_mask_computes_the_selected_rows_with_their_teachers_rows():
    """row_mask: the selected rows' values as without it (each against its own teacher rows and
    tails), the others 0 with no gradient (mutation testing: the mask dropped, or the teachers'
    rows not selected with it, passed every test of ops/topk)."""
    x = torch.randn(6, 20, generator=torch.Generator().manual_seed(4)).requires_grad_()
    ids = topk_ids(x.detach(), 3)
    tlp, ttail = teacher_tensors(2, 6, 20, ids, seed=19)
    mask = torch.tensor([True, False, True, True, False, True])
    whole = topk_opd_loss(x, ids, tlp, ttail, teacher_weights=[0.7, 0.3])
    masked = topk_opd_loss(x, ids, tlp, ttail, teacher_weights=[0.7, 0.3], row_mask=mask)
    torch.testing.assert_close(masked[mask], whole[mask])
    assert bool((masked[~mask] == 0).all()) and bool((whole[~mask] != 0).all())
    masked.sum().backward()
    assert bool((x.grad[~mask] == 0).all()) and bool((x.grad[mask] != 0).any())


def test_topk_kl_of_one_row_without_leading_dims_is_that_rows_value():
    """[k] log-probs and a 0-d tail are one row: topk_kl accepts them (only a 0-d input is refused)."""
    x = torch.randn(4, 20)
    ids = topk_ids(x, 3)
    tlp, ttail = teacher_tensors(2, 4, 20, ids, seed=18)
    slp, stail = topk_logprobs(x, ids)
    one = topk_kl(slp[2], stail[2], tlp[0, 2], ttail[0, 2])
    assert one.shape == ()
    torch.testing.assert_close(one, topk_kl(slp, stail, tlp[0], ttail[0])[2])


def test_bad_inputs_raise_specific_errors_and_change_nothing():
    x, calls = _bad_calls()
    before = x.clone()
    for call, exc, match in calls:
        with pytest.raises(exc, match=match):
            call()
    assert torch.equal(x, before)
