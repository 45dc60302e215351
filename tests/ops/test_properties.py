"""Property test over the public ops' argument space: random shapes, dtypes, strides, devices,
values and options. For every draw the call either raises ValueError/TypeError, or returns results
within fp32 tolerance of a float64 reference computed from the same (rounded) inputs; the inputs
are bitwise unchanged after forward, and after backward unless `inplace_backward=True`.

CI runs a fixed sequence (the "ci" profile); `HYPOTHESIS_PROFILE=long` explores far more.
"""
from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl_patches import log_probs_and_entropy, topk_logprobs

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.float8_e4m3fn]
SPECIALS = [0.0, math.nan, math.inf, -math.inf]


@st.composite
def logits_case(draw):
    T = draw(st.integers(0, 6))
    V = draw(st.integers(1, 12))
    scale = draw(st.sampled_from([0.1, 3.0, 40.0]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(T, V, generator=g, dtype=torch.float64) * scale
    if T and draw(st.booleans()):  # sprinkle special values
        for _ in range(draw(st.integers(1, 3))):
            values[draw(st.integers(0, T - 1)), draw(st.integers(0, V - 1))] = draw(st.sampled_from(SPECIALS))
    dtype = draw(st.sampled_from(DTYPES))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed":
        x = values.t().contiguous().to(dtype).t()
    elif layout == "strided":
        x = torch.zeros(T, 2 * V, dtype=torch.float64).to(dtype)[:, ::2]
        x.copy_(values.to(dtype))
    else:
        x = values.to(dtype)
    device = draw(st.sampled_from(["cpu"] * 5 + ["meta"]))
    return x.to(device) if device == "meta" else x


def _generator(draw) -> torch.Generator:
    """Random tensors from a drawn seed: a replayed example gets the same values."""
    return torch.Generator().manual_seed(draw(st.integers(0, 2**16)))


def _temperature(draw, T):
    kind = draw(st.sampled_from(["one", "float", "tensor0", "per_token", "bad"]))
    if kind == "one":
        return 1.0
    if kind == "float":
        return draw(st.sampled_from([0.3, 0.7, 1.9]))
    if kind == "tensor0":
        return torch.tensor(draw(st.sampled_from([0.5, 1.3])))
    if kind == "per_token":
        return torch.rand(T, dtype=torch.float64, generator=_generator(draw)).add(0.4).float()
    return draw(st.sampled_from([0.0, -1.0, math.nan, 1e-39, True, "1"]))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), for every dtype."""
    a = torch.empty(a.numel(), dtype=a.dtype).copy_(a.detach().reshape(-1))  # dense, stride 1
    b = torch.empty(b.numel(), dtype=b.dtype).copy_(b.detach().reshape(-1))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _unchanged(before) -> None:
    for t, snapshot in before:
        assert same_bits(t, snapshot)


def _reference(x64: torch.Tensor, tokens: torch.Tensor, tau, keep, n_valid: int):
    """float64 log p(target) (over kept ids) and entropy, from the same rounded inputs."""
    tau64 = tau.double().reshape(-1, 1) if isinstance(tau, torch.Tensor) else float(tau)
    z = x64[:, :n_valid] / tau64
    logp_all = torch.log_softmax(z, -1)
    entropy = -(torch.where(logp_all > -math.inf, logp_all.exp() * logp_all, 0.0)).sum(-1)
    kept_z = z if keep is None else z.masked_fill(~keep[:, :n_valid], -math.inf)
    logp = torch.log_softmax(kept_z, -1).gather(1, tokens[:, None]).squeeze(1)
    return logp, entropy


def _close(got: torch.Tensor, want: torch.Tensor, magnitude: float, dtype: torch.dtype) -> bool:
    """fp32 math (fp64 for fp64 inputs): error within a few ulps of the scaled logits' magnitude."""
    eps = 1e-13 if dtype == torch.float64 else 2e-6
    tol = eps * (1.0 + magnitude)
    both_inf = torch.isinf(want) & (got == want)
    return bool((both_inf | ((got.double() - want).abs() <= tol)).all())


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_log_probs_and_entropy_refuses_or_matches_float64(data):
    x = data.draw(logits_case())
    T, V = x.shape
    g = _generator(data.draw)
    tokens = torch.randint(0, V + data.draw(st.sampled_from([0, 0, 0, 2])), (T,), generator=g).to(x.device)
    tokens = tokens.to(data.draw(st.sampled_from([torch.int64, torch.int32, torch.uint32, torch.float32])))
    tau = _temperature(data.draw, T)
    with_entropy = data.draw(st.booleans())
    entropy_grad = data.draw(st.booleans())
    vocab_size = data.draw(st.sampled_from([None, V, max(1, V - 1), V + 1]))
    chunk = data.draw(st.sampled_from([None, 1, 3, 0]))
    keep = (torch.rand(T, V, generator=g) < 0.6) if data.draw(st.booleans()) else None
    if keep is not None:
        keep[torch.arange(T), tokens.long().clamp(0, V - 1)] = True
    leaf = x.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16) and data.draw(st.booleans())
    inplace = data.draw(st.booleans())
    source = x.clone().requires_grad_() if leaf else x
    logits = source if not leaf or data.draw(st.booleans()) else source * 1.0
    before = [(t, t.detach().clone()) for t in (x, tokens, keep, tau) if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    try:
        lp, ent = log_probs_and_entropy(logits, tokens, temperature=tau, with_entropy=with_entropy,
                                        entropy_requires_grad=entropy_grad, chunk_size=chunk, keep_mask=keep,
                                        vocab_size=vocab_size, inplace_backward=inplace)
    except (ValueError, TypeError):
        _unchanged(before)
        return
    _unchanged(before)  # forward changes nothing
    x64 = x.detach().double()
    n_valid = vocab_size or V
    want_lp, want_ent = _reference(x64, tokens.long(), tau, keep, n_valid)
    tau_min = float(tau.min()) if isinstance(tau, torch.Tensor) and tau.numel() else float(tau) if not isinstance(tau, torch.Tensor) else 1.0
    magnitude = float(x64[:, :n_valid].abs().max()) / tau_min if T else 0.0
    assert _close(lp.detach(), want_lp, magnitude, x.dtype)
    if with_entropy:
        assert _close(ent.detach(), want_ent, magnitude, x.dtype)
    if logits.requires_grad:
        loss = lp.sum() + (ent.sum() if with_entropy and entropy_grad else 0.0)
        loss.backward()
        if not inplace:
            _unchanged(before)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_topk_logprobs_refuses_or_matches_float64(data):
    x = data.draw(logits_case())
    T, V = x.shape
    k = data.draw(st.integers(1, max(1, V)))
    g = _generator(data.draw)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    ids = ids.to(data.draw(st.sampled_from([torch.int64, torch.int32, torch.uint16]))).to(x.device)
    tau = _temperature(data.draw, T)
    differentiable = x.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16) and x.device.type != "meta"
    logits = x.clone().requires_grad_() if differentiable else x
    before = [(t, t.detach().clone()) for t in (x, ids) if t.device.type != "meta"]
    try:
        lp, tail = topk_logprobs(logits, ids, temperature=tau)
    except (ValueError, TypeError):
        _unchanged(before)
        return
    x64 = x.detach().double()
    tau64 = tau.double().reshape(-1, 1) if isinstance(tau, torch.Tensor) else float(tau)
    logp_all = torch.log_softmax(x64 / tau64, -1)
    want = logp_all.gather(1, ids.long())
    rest = logp_all.scatter(1, ids.long(), -math.inf)
    want_tail = torch.logsumexp(rest, -1)
    magnitude = float((x64 / tau64).abs().max()) if T else 0.0
    assert _close(lp.detach(), want, magnitude, x.dtype)
    # the tail is exact in log space down to tiny masses: compare where it is not -inf
    assert _close(tail.detach(), want_tail, magnitude, x.dtype)
    if logits.requires_grad and T:
        (lp.sum() + tail.sum()).backward()
    _unchanged(before)
