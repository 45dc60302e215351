"""The fused LM head against float64 references and against the logits ops on `hidden @ W.T`:
values, both gradients, top-k ids and tails, bad inputs, entropy as a metric, no [T, V] tensor."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_patches import (
    lm_head_log_probs_and_entropy,
    lm_head_topk_ids,
    lm_head_topk_logprobs,
    log_probs_and_entropy,
    topk_ids,
    topk_kl,
    topk_logprobs,
    topk_opd_loss,
)
from megatron_rl_patches.ops.kernels import torch_tiles as _lm_head_tiles


def inputs(T=29, H=12, V=157, scale=2.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    w = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    tokens = torch.randint(0, V, (T,), generator=g)
    a = torch.randn(T, generator=g, dtype=torch.float64)
    b = torch.randn(T, generator=g, dtype=torch.float64) * 0.3
    return h, w, tokens, a, b


def run(fn, h, w, a, b, **kwargs):
    """Outputs and (grad_hidden, grad_weight) of loss = Σ a·logp + Σ b·H."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = fn(h, w, **kwargs)
    ((a.to(lp.dtype) * lp).sum() + (b.to(ent.dtype) * ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def fused(h, w, **kw):
    return lm_head_log_probs_and_entropy(h, w, with_entropy=True, **kw)


def logits_path(h, w, **kw):
    return log_probs_and_entropy(h @ w.T, with_entropy=True, **kw)


def err(x, ref):
    return float((x.double() - ref).abs().max())


OPTIONS = [
    {},
    {"temperature": 0.7},
    {"temperature": "per-token"},
    {"keep_mask": True},
    {"chunk_size": 4},
    {"vocab_size": 150},
]


def _options(opt, T, V, tokens, dtype):
    kw = dict(opt)
    if kw.get("temperature") == "per-token":
        kw["temperature"] = (torch.rand(T, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
                             + 0.5).to(dtype)
    if kw.get("keep_mask"):
        keep = torch.rand(T, V, generator=torch.Generator().manual_seed(10)) < 0.5
        kw["keep_mask"] = keep.scatter_(1, tokens[:, None], True)
    return kw, (tokens.clamp(max=kw["vocab_size"] - 1) if "vocab_size" in kw else tokens)


@pytest.mark.parametrize("tile_bytes", [None, 512], ids=["one-tile", "many-vocab-tiles"])
@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_float64_inputs_match_a_float64_reference(opt, tile_bytes, monkeypatch):
    if tile_bytes:
        monkeypatch.setattr(_lm_head_tiles, "CPU_TILE_BYTES", tile_bytes)
    h, w, tokens, a, b = inputs(dtype=torch.float64)
    kw, tokens = _options(opt, 29, 157, tokens, torch.float64)
    want = run(logits_path, h, w, a, b, tokens=tokens, **kw)  # float64 logits path = the reference math
    got = run(fused, h, w, a, b, tokens=tokens, **kw)
    for g, r in zip(got, want):
        assert err(g, r) <= 1e-10 * max(1.0, float(r.abs().max()))


@pytest.mark.parametrize("scale", [2.0, 30.0], ids=["normal", "large-logits"])
@pytest.mark.parametrize("opt", OPTIONS[:3], ids=lambda o: "-".join(o) or "plain")
def test_fp32_error_within_twice_the_logits_path(opt, scale):
    """Against float64 from the same rounded fp32 inputs: ≤ 2× the logits path's error (floor 1e-6)."""
    h, w, tokens, a, b = inputs(scale=scale)
    kw, tokens = _options(opt, 29, 157, tokens, torch.float32)
    kw64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    ref = run(logits_path, h.double(), w.double(), a, b, tokens=tokens, **kw64)
    ours = run(fused, h, w, a, b, tokens=tokens, **kw)
    theirs = run(logits_path, h, w, a, b, tokens=tokens, **kw)
    for name, o, t, r in zip(("log_probs", "entropy", "grad_hidden", "grad_weight"), ours, theirs, ref):
        bound = max(2 * err(t, r), 1e-6 * max(1.0, float(r.abs().max())))
        assert err(o, r) <= bound, (name, err(o, r), err(t, r))


def test_bf16_inputs_follow_the_logits_path():
    h, w, tokens, a, b = inputs(dtype=torch.bfloat16)
    ours = run(fused, h, w, a, b, tokens=tokens)
    theirs = run(logits_path, h, w, a, b, tokens=tokens)
    assert ours[0].dtype == torch.float32 and ours[2].dtype == torch.bfloat16
    assert err(ours[0], theirs[0].double()) <= 1e-5 * 10  # bf16 logits rounded alike; fp32 statistics
    assert err(ours[2].float(), theirs[2].double()) <= 0.05 * float(theirs[2].float().abs().max())


def test_entropy_as_a_metric_does_no_backward_work(monkeypatch):
    h, w, tokens, a, _ = inputs()
    calls = []
    real = _lm_head_tiles.logits_tile
    monkeypatch.setattr("megatron_rl_patches.ops.kernels.torch_tiles.logits_tile",
                        lambda *args: calls.append(1) or real(*args))
    hh = h.clone().requires_grad_()
    lp, ent = lm_head_log_probs_and_entropy(hh, w, tokens, with_entropy=True, entropy_requires_grad=False)
    forward_tiles = len(calls)
    assert not ent.requires_grad
    (ent.sum() * 0 + 0).backward() if ent.requires_grad else None
    assert len(calls) == forward_tiles  # no backward pass for a metric
    lp.sum().backward()
    assert len(calls) == 2 * forward_tiles  # one recompute pass for the log-probs
    want = run(logits_path, h, w, a * 0 + 1, a * 0, tokens=tokens)
    assert err(hh.grad, want[2].double()) <= 1e-5


def test_no_tensor_of_t_by_v_is_allocated(monkeypatch):
    """The largest tensor the op creates is a tile, far below T·V elements."""
    from torch.utils._python_dispatch import TorchDispatchMode

    T, V = 256, 2048
    h, w, tokens, a, b = inputs(T=T, V=V, H=8)
    monkeypatch.setattr(_lm_head_tiles, "CPU_TILE_BYTES", 64 << 10)

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.most = max(Largest.most, t.numel())
            return out

    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    ids = topk_ids(h @ w.T, 4)  # the test's own logits, outside the measured region
    with Largest():
        lp, ent = lm_head_log_probs_and_entropy(hh, ww, tokens, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        lp2, tail = lm_head_topk_logprobs(hh, ww, ids)
        lm_head_topk_ids(hh, ww, 4)
        (lp2.sum() + tail.sum()).backward()
    assert Largest.most <= max(V * 8, 16 * 1024 + 1), Largest.most  # the weight itself; tiles of 16k floats
    assert Largest.most < T * V // 8


# ----------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_ids_equal_the_logits_op_ties_included(dtype):
    h, w, *_ = inputs(T=40, V=300, dtype=dtype)
    if dtype == torch.bfloat16:
        h = (h * 0.2).round().to(dtype)  # many tied logits
    for k in (1, 7, 33):
        assert torch.equal(lm_head_topk_ids(h, w, k, chunk_size=7), topk_ids(h @ w.T, k))


@pytest.mark.parametrize("tile_bytes", [None, 512], ids=["one-tile", "many-vocab-tiles"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_topk_ids_tie_in_every_vocab_tile_is_exact_in_every_dtype(dtype, tile_bytes, monkeypatch):
    """Integer-valued h and W: logits exact in any dtype and tied in blocks, so most vocabulary
    tiles cut inside a block of equal values; fp64 is ranked exactly too (no fp32 key)."""
    if tile_bytes:
        monkeypatch.setattr(_lm_head_tiles, "CPU_TILE_BYTES", tile_bytes)
    g = torch.Generator().manual_seed(5)
    h = torch.randint(-2, 3, (30, 4), generator=g).to(dtype)
    w = torch.randint(-1, 2, (250, 4), generator=g).to(dtype)
    stable = torch.sort((h @ w.T).double(), dim=1, descending=True, stable=True).indices
    for k in (1, 6, 40):
        for chunk in (None, 7):
            assert torch.equal(lm_head_topk_ids(h, w, k, chunk_size=chunk), stable[:, :k]), (k, chunk)


@pytest.mark.parametrize("tile_bytes", [None, 512], ids=["one-tile", "many-vocab-tiles"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_topk_logprobs_and_tail_match(dtype, tile_bytes, monkeypatch):
    if tile_bytes:  # ids outside a vocab tile must not disturb the marks of those inside it
        monkeypatch.setattr(_lm_head_tiles, "CPU_TILE_BYTES", tile_bytes)
    h, w, *_ = inputs(dtype=dtype, scale=3.0)
    ids = topk_ids((h @ w.T).float(), 6)
    g = torch.randn(29, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def loss(fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, tail = fn(hh, ww)
        ((g.to(lp.dtype) * lp).sum() + tail.sum()).backward()
        return lp.detach(), tail.detach(), hh.grad, ww.grad

    ours = loss(lambda hh, ww: lm_head_topk_logprobs(hh, ww, ids, temperature=0.8, chunk_size=5))
    theirs = loss(lambda hh, ww: topk_logprobs(hh @ ww.T, ids, temperature=0.8))
    tol = 1e-10 if dtype == torch.float64 else 2e-6
    for o, t in zip(ours, theirs):
        assert err(o, t.double()) <= tol * max(1.0, float(t.abs().max()))


@pytest.mark.parametrize("tail_mass", [1e-8, 1e-12, 1e-20])
def test_tail_is_exact_for_tiny_tail_masses(tail_mass):
    """Ids holding all but `tail_mass`: the tail's log stays exact (log(1 − Σp) would be -inf or 0)."""
    T, H, V, k = 4, 4, 50, 3
    h = torch.eye(H)[:T].double() * 1.0
    w = torch.zeros(V, H, dtype=torch.float64)
    gap = math.log((V - k) / tail_mass)  # the k ids sit `gap` above the other V - k logits
    w[:k] = gap
    lp, tail = lm_head_topk_logprobs(h.float(), w.float(), torch.arange(k).expand(T, k))
    want = math.log(tail_mass / (k + tail_mass))
    assert abs(float(tail.max()) - want) <= 1e-5 * abs(want)
    assert bool(torch.isfinite(tail).all())


def test_fused_opd_equals_the_logits_opd():
    h, w, *_ = inputs(scale=2.0)
    teacher_w = [w + 0.3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    ids = lm_head_topk_ids(h, w, 5)
    with torch.no_grad():
        buckets = [lm_head_topk_logprobs(h, tw, ids) for tw in teacher_w]
    t_lp, t_tail = torch.stack([x for x, _ in buckets]), torch.stack([y for _, y in buckets])
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    fused_loss = topk_kl(*lm_head_topk_logprobs(h1, w1, ids), t_lp, t_tail, teacher_weights=[1.0, 3.0])
    fused_loss.sum().backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.no_grad():
        ref_buckets = [topk_logprobs(h @ tw.T, ids) for tw in teacher_w]
    ref_loss = topk_opd_loss(h2 @ w2.T, ids, torch.stack([x for x, _ in ref_buckets]),
                             torch.stack([y for _, y in ref_buckets]), teacher_weights=[1.0, 3.0])
    ref_loss.sum().backward()
    assert err(fused_loss.detach(), ref_loss.detach().double()) <= 2e-6
    assert err(h1.grad, h2.grad.double()) <= 2e-6 and err(w1.grad, w2.grad.double()) <= 2e-6


# ----------------------------------------------------------------------------- bad inputs


def test_bad_inputs_name_the_argument_and_change_nothing():
    h, w, tokens, *_ = inputs()
    snapshot = [t.clone() for t in (h, w, tokens)]
    nan_h = h.clone()
    nan_h[3, 0] = math.nan
    cases = [
        (lambda: lm_head_log_probs_and_entropy(h.long(), w, tokens), TypeError, "hidden must be a floating tensor"),
        (lambda: lm_head_log_probs_and_entropy(h, w[:, :5], tokens), ValueError, "weight must be \\[V_local, H\\]"),
        (lambda: lm_head_log_probs_and_entropy(h, w.double(), tokens), ValueError, "share dtype and device"),
        (lambda: lm_head_log_probs_and_entropy(h, w, tokens[:5]), ValueError, "tokens must have shape"),
        (lambda: lm_head_log_probs_and_entropy(h, w, tokens + 1000), ValueError, "global ids in \\[0, 157\\)"),
        (lambda: lm_head_log_probs_and_entropy(h, w, tokens.float()), TypeError, "tokens must be an integer"),
        (lambda: lm_head_log_probs_and_entropy(h, w, tokens, temperature=0.0), ValueError, "temperature"),
        (lambda: lm_head_log_probs_and_entropy(h, w, tokens, temperature=1e-39), ValueError, "temperature must be >="),
        (lambda: lm_head_log_probs_and_entropy(nan_h, w, tokens), ValueError, "rows \\[3\\] contain NaN"),
        (lambda: lm_head_log_probs_and_entropy(h, w, tokens, chunk_size=0), ValueError, "chunk_size"),
        (lambda: lm_head_log_probs_and_entropy(h, w, tokens, sequence_parallel="yes"), TypeError, "sequence_parallel"),
        (lambda: lm_head_topk_ids(h, w, 0), ValueError, "k must be a positive int"),
        (lambda: lm_head_topk_ids(nan_h, w, 3), ValueError, "rows \\[3\\] contain NaN"),
        (lambda: lm_head_topk_logprobs(h, w, topk_ids(h @ w.T, 3).float()), TypeError, "ids must be an integer"),
        (lambda: lm_head_log_probs_and_entropy(h.to("meta"), w.to("meta"), tokens), ValueError, "meta device"),
    ]
    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()
    for before, after in zip(snapshot, (h, w, tokens)):
        assert torch.equal(before, after)


def test_double_backward_is_refused():
    h, w, tokens, *_ = inputs()
    hh = h.clone().requires_grad_()
    lp, _ = lm_head_log_probs_and_entropy(hh, w, tokens)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(lp.sum(), hh, create_graph=True)
