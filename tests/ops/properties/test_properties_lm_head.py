"""Property tests of the fused LM head (lm_head_log_probs_and_entropy, lm_head_topk_ids,
lm_head_topk_logprobs) over hostile arguments: dtypes, layouts, devices (cpu, meta), temperatures,
ids, k, chunk sizes, masks. Each call either raises ValueError/TypeError with the inputs unchanged
(values, requires_grad, .grad), or matches a float64 reference computed from the same rounded
hidden states and weight; after backward the inputs are still unchanged."""
from __future__ import annotations

import math

import torch
from hypothesis import event, given
from hypothesis import strategies as st
from property_kit import (
    CHUNKS,
    DTYPES,
    FLOATS,
    SETTINGS,
    close,
    generator,
    layout,
    snapshot,
    tau64,
    temperature,
    unchanged,
)

from megatron_rl_patches import lm_head_log_probs_and_entropy, lm_head_topk_ids, lm_head_topk_logprobs
from megatron_rl_patches.testing.logprob_reference import reference_log_probs

REFUSED = (ValueError, TypeError)


@st.composite
def head_case(draw):
    """hidden [T, H] and weight [V, H] of one drawn dtype (sometimes two), layouts, devices."""
    T, H, V = draw(st.integers(0, 5)), draw(st.integers(1, 6)), draw(st.integers(1, 10))
    g = generator(draw)
    scale = draw(st.sampled_from([0.3, 1.0, 4.0]))
    h = torch.randn(T, H, generator=g, dtype=torch.float64) * scale
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * scale
    if T and draw(st.integers(0, 5)) == 5:
        h[draw(st.integers(0, T - 1)), 0] = draw(st.sampled_from([math.nan, math.inf]))
    dtype = draw(st.sampled_from(FLOATS * 3 + DTYPES))
    hidden = layout(draw, h, dtype)
    weight = layout(draw, w, dtype if draw(st.integers(0, 7)) < 7 else draw(st.sampled_from(DTYPES)))
    if draw(st.integers(0, 7)) == 7:
        hidden, weight = hidden.to("meta"), weight.to("meta")
    grad = hidden.dtype.is_floating_point and hidden.dtype != torch.float8_e4m3fn and draw(st.booleans())
    if grad and hidden.device.type != "meta":
        hidden = hidden.clone().requires_grad_()
        weight = weight.clone().requires_grad_(weight.dtype.is_floating_point and weight.dtype != torch.float8_e4m3fn)
    return hidden, weight


def _logits64(hidden, weight, tau):
    return (hidden.detach().double() @ weight.detach().double().T) / tau64(tau)


def _magnitude(z64: torch.Tensor) -> float:
    finite = z64[torch.isfinite(z64)]
    return float(finite.abs().max()) if finite.numel() else 0.0


@SETTINGS
@given(data=st.data())
def test_lm_head_log_probs_refuses_or_matches_float64(data):
    hidden, weight = data.draw(head_case())
    T, V = hidden.shape[0], weight.shape[0]
    g = generator(data.draw)
    tokens = torch.randint(0, V + data.draw(st.sampled_from([0, 0, 0, 2])), (T,), generator=g)
    tokens = tokens.to(data.draw(st.sampled_from([torch.int64, torch.int32, torch.float32])))
    tau = temperature(data.draw, T)
    with_entropy, entropy_grad = data.draw(st.booleans()), data.draw(st.booleans())
    vocab_size = data.draw(st.sampled_from([None, None, V, max(1, V - 1), V + 1, 0]))
    chunk = data.draw(st.sampled_from(CHUNKS))
    keep = (torch.rand(T, V, generator=g) < 0.6) if data.draw(st.booleans()) else None
    if keep is not None:
        keep[torch.arange(T), tokens.long().clamp(0, V - 1)] = True
    before = snapshot(hidden, weight, tokens, keep, tau)
    try:
        lp, ent = lm_head_log_probs_and_entropy(hidden, weight, tokens, temperature=tau, with_entropy=with_entropy,
                                                entropy_requires_grad=entropy_grad, keep_mask=keep,
                                                vocab_size=vocab_size, chunk_size=chunk)
    except REFUSED as exc:
        event(f"refused: {type(exc).__name__} {str(exc)[:50]}")
        unchanged(before)
        return
    unchanged(before)
    n = vocab_size or V
    z = _logits64(hidden, weight, tau)[:, :n]
    want_lp, want_ent = reference_log_probs(z, tokens.long(), keep_mask=keep)
    event("compared")
    finite_rows = torch.isfinite(z).all(-1)  # NaN/inf hidden rows: refused, or NaN out; not compared
    magnitude = _magnitude(z)
    assert close(lp.detach()[finite_rows], want_lp[finite_rows], magnitude, hidden.dtype)
    if with_entropy:
        assert close(ent.detach()[finite_rows], want_ent[finite_rows], magnitude, hidden.dtype)
    if lp.requires_grad:
        (lp.sum() + (ent.sum() if with_entropy and ent.requires_grad else 0.0)).backward()
        unchanged(before, grads=False)


@SETTINGS
@given(data=st.data())
def test_lm_head_topk_refuses_or_matches_float64(data):
    hidden, weight = data.draw(head_case())
    T, V = hidden.shape[0], weight.shape[0]
    k = data.draw(st.sampled_from([1, 2, max(1, V - 1)] * 4 + [V, V + 1, 0, -1, True, 2.0]))
    tau = temperature(data.draw, T)
    chunk = data.draw(st.sampled_from(CHUNKS))
    before = snapshot(hidden, weight, tau)
    try:
        ids = lm_head_topk_ids(hidden, weight, k, temperature=tau, chunk_size=chunk)
    except REFUSED as exc:
        event(f"refused: {type(exc).__name__} {str(exc)[:50]}")
        unchanged(before)
        return
    unchanged(before)
    z = _logits64(hidden, weight, tau)
    assert ids.shape == (T, k) and not ids.requires_grad
    # the chosen ids hold the k largest logits (ids may differ among near-ties)
    magnitude = _magnitude(z)
    assert close(z.gather(1, ids), z.topk(k, dim=1).values, magnitude, hidden.dtype)
    if data.draw(st.booleans()) and T:
        ids = torch.stack([torch.randperm(V, generator=generator(data.draw))[:k] for _ in range(T)])
    ids = ids.to(data.draw(st.sampled_from([torch.int64, torch.int32] * 3 + [torch.float32])))
    before = snapshot(hidden, weight, tau, ids)
    try:
        lp, tail = lm_head_topk_logprobs(hidden, weight, ids, temperature=tau, chunk_size=chunk)
    except REFUSED as exc:
        event(f"refused: {type(exc).__name__} {str(exc)[:50]}")
        unchanged(before)
        return
    unchanged(before)
    event("compared")
    logp_all = torch.log_softmax(z, -1)
    assert close(lp, logp_all.gather(1, ids.long()), magnitude, hidden.dtype)
    assert close(tail, torch.logsumexp(logp_all.scatter(1, ids.long(), -math.inf), -1), magnitude, hidden.dtype)
    if lp.requires_grad and T:
        (lp.sum() + tail.sum()).backward()
        unchanged(before, grads=False)
