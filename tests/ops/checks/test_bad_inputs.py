"""Issue 12's bad inputs to the ops: each is refused with a ValueError/TypeError (or a named
RuntimeError) that names the argument, and leaves the caller's tensors bitwise unchanged. Every
case here was accepted, or failed obscurely, before the fix."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_patches import log_probs_and_entropy, topk_ids, topk_kl, topk_logprobs, topk_opd_loss

# Tests of the deprecated kl=/mix= (and of forms reachable only through them): opted out of the
# suite-wide "the package's deprecations are errors" filter (pyproject.toml).
pytestmark = pytest.mark.filterwarnings("ignore:kl=/mix= are deprecated:DeprecationWarning")

INF = math.inf


def _inputs(T=6, V=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, V, generator=g) * 2, torch.randint(0, V, (T,), generator=g)


def unchanged(*tensors):
    """Snapshots; call the result to assert the tensors are bitwise what they were."""
    saved = [(t, t.detach().clone()) for t in tensors]

    def check():
        for t, before in saved:
            assert torch.equal(t.detach().nan_to_num(), before.nan_to_num())

    return check


# ----------------------------------------------------------------------- 1: in-place into a leaf


@pytest.mark.parametrize(
    "make",
    [lambda: torch.randn(30, requires_grad=True), lambda: torch.nn.Parameter(torch.randn(6, 5))],
    ids=["leaf", "parameter"],
)
@pytest.mark.parametrize("view", [lambda t: t.view(6, 5), lambda t: t.view(6, 5)[:, :]], ids=["view", "slice"])
def test_inplace_backward_refuses_views_of_a_leaf(make, view):
    """Before: accepted, and backward overwrote the leaf's values (leaf.grad aliased the leaf)."""
    base = make()
    _, tokens = _inputs()
    check = unchanged(base)
    with pytest.raises(ValueError, match="inplace_backward=True would overwrite a leaf"):
        log_probs_and_entropy(view(base), tokens, inplace_backward=True)
    check()
    nonleaf = base.view(6, 5) * 1.0  # what a model produces: still accepted, the leaf untouched
    log_probs_and_entropy(nonleaf, tokens, inplace_backward=True)[0].sum().backward()
    check()
    assert base.grad is not None and base.grad.data_ptr() != base.data_ptr()


# ----------------------------------------------------------------------- 10: overlap check at T = 1


def test_inplace_backward_refuses_overlapping_columns_at_call_time_for_one_row():
    x = torch.randn(1, 1, requires_grad=True)
    logits = (x * 1.0).expand(1, 5)  # stride 0 columns, T = 1
    with pytest.raises(ValueError, match="do not overlap in memory"):
        log_probs_and_entropy(logits, torch.tensor([2]), inplace_backward=True)


# ----------------------------------------------------------------------- 2: NaN / +inf rows in top-k


@pytest.mark.parametrize(
    ("value", "pattern"),
    [(math.nan, r"rows \[3\] contain NaN or \+inf"), (INF, r"rows \[3\] contain NaN or \+inf"),
     (None, r"rows \[3\] are entirely -inf")],
    ids=["nan", "posinf", "all-neginf"],
)
def test_topk_ops_reject_bad_rows(value, pattern):
    logits, _ = _inputs(V=8)
    if value is None:
        logits[3] = -INF
    else:
        logits[3, 5] = value
    ids = torch.tensor([[0, 1]] * 6)
    teachers = torch.full((6, 2), -2.0)
    check = unchanged(logits)
    with pytest.raises(ValueError, match="topk_ids: logits " + pattern):
        topk_ids(logits, 2)
    with pytest.raises(ValueError, match="topk_logprobs: logits " + pattern):
        topk_logprobs(logits, ids)
    with pytest.raises(ValueError, match="topk_opd_loss: student_logits " + pattern):
        topk_opd_loss(logits.requires_grad_(), ids, teachers)
    check()


def test_neg_inf_entries_stay_legal_in_topk():
    logits, _ = _inputs(V=8)
    logits[:, 6:] = -INF  # masked ids
    ids = topk_ids(logits, 3)
    assert bool((ids < 6).all())
    lp, tail = topk_logprobs(logits, torch.tensor([[6, 0, 1]] * 6))
    assert bool(torch.isneginf(lp[:, 0]).all()) and bool(torch.isfinite(tail).all())


# ----------------------------------------------------------------------- 3: teacher values and weights


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [(math.nan, "teacher_logprobs must be log-probabilities"), (INF, "teacher_logprobs must be log-probabilities"),
     (0.5, "teacher_logprobs must be log-probabilities")],
    ids=["nan", "posinf", "positive"],
)
def test_opd_rejects_teacher_values_that_are_not_log_probs(bad, pattern):
    logits, _ = _inputs(V=8)
    logits.requires_grad_()
    ids = topk_ids(logits, 2)
    teachers = torch.full((2, 6, 2), -2.0)
    teachers[1, 4, 0] = bad
    check = unchanged(logits, teachers)
    with pytest.raises(ValueError, match=pattern):
        topk_opd_loss(logits, ids, teachers)
    tails = torch.full((2, 6), -1.0)
    tails[0, 2] = bad
    with pytest.raises(ValueError, match="teacher_tail_logprobs must be log-probabilities"):
        topk_opd_loss(logits, ids, torch.full((2, 6, 2), -2.0), tails)
    check()


def test_opd_keeps_zero_and_neg_inf_teacher_log_probs_legal():
    logits, _ = _inputs(V=8)
    ids = topk_ids(logits, 2)
    teachers = torch.full((6, 2), -2.0)
    teachers[0, 0] = 0.0  # probability 1 (the derived tail is clamped)
    teachers[1, 1] = -INF  # probability 0: documented +inf KL for the reverse direction
    loss = topk_opd_loss(logits.clone().requires_grad_(), ids, teachers)
    assert math.isinf(float(loss[1])) and bool(torch.isfinite(loss[2:]).all())


@pytest.mark.parametrize(
    ("weights", "pattern"),
    [([1e308, 1e308], "finite sum"), ([math.nan, 1.0], "finite and >= 0"), ([math.inf, 1.0], "finite and >= 0")],
    ids=["sum-overflows", "nan", "inf"],
)
def test_opd_rejects_weights_that_are_not_finite_or_overflow(weights, pattern):
    logits, _ = _inputs(V=8)
    ids = topk_ids(logits, 2)
    with pytest.raises(ValueError, match=pattern):
        topk_opd_loss(logits.clone().requires_grad_(), ids, torch.full((2, 6, 2), -2.0), teacher_weights=weights)


# ----------------------------------------------------------------------- 9: 1/temperature overflow


@pytest.mark.parametrize("tau", [1e-39, torch.tensor(1e-39), torch.full((6,), 1e-39)],
                         ids=["float", "0-d", "per-token"])
def test_temperature_whose_inverse_overflows_is_rejected(tau):
    logits, tokens = _inputs(V=8)
    with pytest.raises(ValueError, match=r"temperature must be >= 4\.2\d*e-39"):
        log_probs_and_entropy(logits, tokens, temperature=tau)
    with pytest.raises(ValueError, match=r"temperature must be >= 4\.2\d*e-39"):
        topk_logprobs(logits, topk_ids(logits, 2), temperature=tau)
    # fp64 logits compute in fp64: the same temperature is fine there
    lp, _ = log_probs_and_entropy(logits.double(), tokens,
                                  temperature=tau if not isinstance(tau, torch.Tensor) else tau.double())
    assert bool(torch.isfinite(lp).all() | torch.isneginf(lp).all())


# ----------------------------------------------------------------------- 11: dtypes and devices


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_wide_unsigned_ids_are_refused_by_name(dtype):
    logits, tokens = _inputs(V=8)
    with pytest.raises(TypeError, match=f"tokens must be an integer tensor of ids.*{dtype}"):
        log_probs_and_entropy(logits, tokens.to(dtype))
    with pytest.raises(TypeError, match=f"ids must be an integer tensor of ids.*{dtype}"):
        topk_logprobs(logits, topk_ids(logits, 2).to(dtype))


def test_float8_and_meta_tensors_are_refused_by_name():
    logits, tokens = _inputs(V=8)
    with pytest.raises(TypeError, match="logits must be a floating tensor.*float8"):
        log_probs_and_entropy(logits.to(torch.float8_e4m3fn), tokens)
    with pytest.raises(TypeError, match="logits must be a floating tensor.*float8"):
        topk_ids(logits.to(torch.float8_e4m3fn), 2)
    meta = torch.empty(6, 8, device="meta")
    with pytest.raises(ValueError, match="logits is on the meta device"):
        log_probs_and_entropy(meta, tokens.to("meta"))
    with pytest.raises(ValueError, match="logits is on the meta device"):
        topk_ids(meta, 2)
    ids = topk_ids(logits, 2)
    with pytest.raises(ValueError, match="teacher_logprobs is on the meta device"):
        topk_opd_loss(logits.clone().requires_grad_(), ids, torch.empty(6, 2, device="meta"))


# ----------------------------------------------------------------------- 13: double backward


def test_double_backward_is_refused_not_silently_wrong():
    logits, tokens = _inputs(V=8)
    x = logits.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(x, tokens, with_entropy=True)
    with pytest.raises(RuntimeError, match="create_graph=True.*not supported"):
        torch.autograd.grad((lp.sum() + ent.sum()), x, create_graph=True)
    y = logits.clone().requires_grad_()
    tlp, tail = topk_logprobs(y, topk_ids(logits, 2))
    with pytest.raises(RuntimeError, match="create_graph=True.*not supported"):
        torch.autograd.grad(tlp.sum() + tail.sum(), y, create_graph=True)
    # plain backward still works
    lp, _ = log_probs_and_entropy(x, tokens)
    (grad,) = torch.autograd.grad(lp.sum(), x)
    assert grad.shape == x.shape


# ----------------------------------------------------------------------- topk_kl (issue 14 item 1)


def test_topk_kl_is_topk_opd_loss_split_in_two():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 40, generator=g, dtype=torch.float64) * 2
    ids = topk_ids(logits, 4)
    teachers = torch.stack([torch.log_softmax(logits * s, -1).gather(-1, ids) for s in (0.7, 1.4)])
    for kl in ("reverse", "forward", "mixed"):
        a = logits.clone().requires_grad_()
        whole = topk_opd_loss(a, ids, teachers, teacher_weights=[1.0, 2.0], kl=kl, mix=0.3)
        whole.sum().backward()
        b = logits.clone().requires_grad_()
        split = topk_kl(*topk_logprobs(b, ids), teachers, teacher_weights=[1.0, 2.0], kl=kl, mix=0.3)
        split.sum().backward()
        assert torch.equal(whole, split) and torch.equal(a.grad, b.grad)


def test_topk_kl_validates_its_buckets():
    lp = torch.log_softmax(torch.randn(3, 5), -1)[:, :4]
    tail = torch.logsumexp(torch.log_softmax(torch.randn(3, 5), -1)[:, 4:], -1)
    with pytest.raises(ValueError, match="student_tail must have shape"):
        topk_kl(lp, tail[:2], lp)
    with pytest.raises(ValueError, match="student_logprobs must be log-probabilities"):
        topk_kl(lp.abs() + 1, tail, lp)
    with pytest.raises(ValueError, match="kl must be one of"):
        topk_kl(lp, tail, lp, kl="sideways")
    with pytest.raises(ValueError, match="teacher_logprobs must have shape"):
        topk_kl(lp, tail, lp[:, :3])
