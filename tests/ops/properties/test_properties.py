"""Property test over the public ops' argument space: random shapes, dtypes, strides, devices,
values and options. For every draw the call either raises ValueError/TypeError, or returns results
within fp32 tolerance of a float64 reference computed from the same (rounded) inputs; the inputs
are bitwise unchanged after forward, and after backward unless `inplace_backward=True`.

CI runs a fixed sequence (the "ci" profile); `HYPOTHESIS_PROFILE=long` explores far more.
"""
from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st
from property_kit import SETTINGS, close, generator, logits_case, min_tau, snapshot, tau64, temperature, unchanged

from megatron_rl_patches import log_probs_and_entropy, topk_logprobs
from megatron_rl_patches.testing.logprob_reference import reference_log_probs


def _reference(x64: torch.Tensor, tokens: torch.Tensor, tau, keep, n_valid: int):
    """float64 log p(target) (over kept ids) and entropy, from the same rounded inputs."""
    return reference_log_probs(x64, tokens, temperature=tau64(tau), keep_mask=keep, vocab_size=n_valid)


@SETTINGS
@given(data=st.data())
def test_log_probs_and_entropy_refuses_or_matches_float64(data):
    x = data.draw(logits_case())
    T, V = x.shape
    g = generator(data.draw)
    tokens = torch.randint(0, V + data.draw(st.sampled_from([0, 0, 0, 2])), (T,), generator=g).to(x.device)
    tokens = tokens.to(data.draw(st.sampled_from([torch.int64, torch.int32, torch.uint32, torch.float32])))
    tau = temperature(data.draw, T)
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
    before = snapshot(x, tokens, keep, tau, source)
    try:
        lp, ent = log_probs_and_entropy(logits, tokens, temperature=tau, with_entropy=with_entropy,
                                        entropy_requires_grad=entropy_grad, chunk_size=chunk, keep_mask=keep,
                                        vocab_size=vocab_size, inplace_backward=inplace)
    except (ValueError, TypeError):
        unchanged(before)
        return
    unchanged(before)  # forward changes nothing
    x64 = x.detach().double()
    n_valid = vocab_size or V
    want_lp, want_ent = _reference(x64, tokens.long(), tau, keep, n_valid)
    magnitude = float(x64[:, :n_valid].abs().max()) / min_tau(tau) if T else 0.0
    assert close(lp.detach(), want_lp, magnitude, x.dtype)
    if with_entropy:
        assert close(ent.detach(), want_ent, magnitude, x.dtype)
    if logits.requires_grad:
        loss = lp.sum() + (ent.sum() if with_entropy and entropy_grad else 0.0)
        loss.backward()
        if not inplace:
            unchanged(before, grads=False)


@SETTINGS
@given(data=st.data())
def test_topk_logprobs_refuses_or_matches_float64(data):
    x = data.draw(logits_case())
    T, V = x.shape
    k = data.draw(st.integers(1, max(1, V)))
    g = generator(data.draw)
    ids = (torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(T)]) if T
           else torch.zeros(0, k, dtype=torch.long))
    ids = ids.to(data.draw(st.sampled_from([torch.int64, torch.int32, torch.uint16]))).to(x.device)
    tau = temperature(data.draw, T)
    differentiable = (x.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
                      and x.device.type != "meta")
    logits = x.clone().requires_grad_() if differentiable else x
    before = snapshot(x, ids, tau, logits)
    try:
        lp, tail = topk_logprobs(logits, ids, temperature=tau)
    except (ValueError, TypeError):
        unchanged(before)
        return
    x64 = x.detach().double()
    logp_all = torch.log_softmax(x64 / tau64(tau), -1)
    want = logp_all.gather(1, ids.long())
    rest = logp_all.scatter(1, ids.long(), -math.inf)
    want_tail = torch.logsumexp(rest, -1)
    magnitude = float((x64 / tau64(tau)).abs().max()) if T else 0.0
    assert close(lp.detach(), want, magnitude, x.dtype)
    # the tail is exact in log space down to tiny masses: compare where it is not -inf
    assert close(tail.detach(), want_tail, magnitude, x.dtype)
    if logits.requires_grad and T:
        (lp.sum() + tail.sum()).backward()
    unchanged(before, grads=False)
