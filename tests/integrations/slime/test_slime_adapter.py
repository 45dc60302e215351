"""slime adapter: slime's signature, shapes and math (float64 reference of slime's unfused code).

TP=2 (gloo, tp_group=None meaning the default group) runs inside the TP=2 spawn of
test_logprobs_tp.py to save a process launch.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch

from megatron_rl_patches.integrations.slime import (
    calculate_log_probs_and_entropy,
    calculate_log_probs_and_entropy_wrapper,
)
from megatron_rl_patches.integrations.slime import logprobs as slime_integration


def slime_reference(logits, tokens, keep=None):
    """slime's math unfused in float64: max-subtract, exp, sum, log; entropy m + log S - Σ p·z."""
    x = logits.double()
    m = x.max(-1, keepdim=True).values
    ex = (x - m).exp()
    s = ex.sum(-1, keepdim=True)
    p = ex / s
    ent = (m + s.log() - (p * x).sum(-1, keepdim=True)).squeeze(-1)
    xk = x
    if keep is not None:
        kept = keep.clone()
        kept[torch.arange(x.size(0)), tokens] = True
        xk = x.masked_fill(~kept, -math.inf)
    mk = xk.max(-1, keepdim=True).values
    sk = (xk - mk).exp().sum(-1, keepdim=True)
    lp = xk.gather(1, tokens[:, None]) - mk - sk.log()
    return lp, ent


def make(T=19, V=57, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, V, generator=g) * 3, torch.randint(0, V, (T,), generator=g),
            torch.randn(T, generator=g), torch.randn(T, generator=g), torch.rand(T, V, generator=g) < 0.3)


@pytest.mark.parametrize("chunk_size", [-1, 0, 4])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("with_entropy_grad", [True, False])
def test_matches_slime_math_in_float64(chunk_size, masked, with_entropy_grad):
    logits, tokens, a, b, keep = make(seed=chunk_size + 7)
    keep = keep if masked else None
    x = logits.clone().requires_grad_()
    lp, ent = calculate_log_probs_and_entropy(x, tokens, None, with_entropy=True, chunk_size=chunk_size,
                                              log_prob_keep_mask=keep, with_entropy_grad=with_entropy_grad)
    assert lp.shape == (19, 1) and ent.shape == (19,)
    assert ent.requires_grad is with_entropy_grad
    loss = (lp.squeeze(-1) * a).sum() + ((ent * b).sum() if with_entropy_grad else 0.0)
    loss.backward()

    x64 = logits.double().requires_grad_()
    lp64, ent64 = slime_reference(x64, tokens, keep)
    ((lp64.squeeze(-1) * a.double()).sum() + ((ent64 * b.double()).sum() if with_entropy_grad else 0.0)).backward()
    assert (lp.double() - lp64.detach()).abs().max() <= 1e-6
    assert (ent.detach().double() - ent64.detach()).abs().max() <= 1e-6
    assert (x.grad.double() - x64.grad).abs().max() <= 1e-6


def test_return_shapes():
    logits, tokens, *_ = make(T=5, V=9)
    lp, ent = calculate_log_probs_and_entropy(logits, tokens, None)
    assert lp.shape == (5, 1) and ent is None
    lp, ent = calculate_log_probs_and_entropy(logits[:0], tokens[:0], None, with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    lp, ent = calculate_log_probs_and_entropy(logits[:0], tokens[:0], None)
    assert lp.shape == (0,) and ent is None


def test_wrapper_binds_positional_and_keyword_calls():
    logits, tokens, *_ , keep = make(T=6, V=11)

    def never(*args, **kwargs):
        raise AssertionError("the wrapper must not call slime's original")

    positional = calculate_log_probs_and_entropy_wrapper(never, None, (logits, tokens, None, True, 2, keep), {})
    keyword = calculate_log_probs_and_entropy_wrapper(
        never, None, (), dict(logits=logits, tokens=tokens, tp_group=None, with_entropy=True, log_prob_keep_mask=keep)
    )
    direct = calculate_log_probs_and_entropy(logits, tokens, None, with_entropy=True, log_prob_keep_mask=keep)
    for got in (positional, keyword):
        torch.testing.assert_close(got[0], direct[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], direct[1], rtol=0, atol=0)


def test_wrapper_hands_unknown_arguments_to_slime_with_one_warning(caplog):
    logits, tokens, *_ = make(T=3, V=5)
    calls = []

    def newer_slime(logits, tokens, tp_group, with_entropy=False, reuse_logits_storage_for_backward=False):
        calls.append(reuse_logits_storage_for_backward)
        return "original"

    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        out = calculate_log_probs_and_entropy_wrapper(
            newer_slime, None, (logits, tokens, None), {"reuse_logits_storage_for_backward": True}
        )
    assert out == "original" and calls == [True]
    assert "slime_logprobs" in caplog.text
    with pytest.raises(TypeError, match="bogus"):  # slime's own error for a bad call
        calculate_log_probs_and_entropy_wrapper(newer_slime, None, (logits, tokens, None), {"bogus": 1})


def test_wrapper_binds_to_the_installed_forks_parameter_order(monkeypatch):
    """A fork with another parameter order: positional values must land on the right names."""
    from megatron_rl_patches.integrations.slime import logprobs as adapter

    seen = {}

    def fork(logits, tokens, tp_group, with_entropy=False, entropy_no_grad=False, chunk_size=-1):
        raise AssertionError("not called while every argument is understood")

    def spy(**kwargs):
        seen.update(kwargs)
        return "adapter"

    monkeypatch.setattr(adapter, "calculate_log_probs_and_entropy", spy)
    monkeypatch.setattr(adapter.calculate_log_probs_and_entropy, "__signature__",
                        __import__("inspect").signature(calculate_log_probs_and_entropy), raising=False)
    logits, tokens, *_ = make(T=3, V=5)
    assert calculate_log_probs_and_entropy_wrapper(fork, None, (logits, tokens, None, True, False, 4), {}) == "adapter"
    assert seen["with_entropy"] is True and seen["chunk_size"] == 4 and "entropy_no_grad" not in seen

    calls = []

    def fork_used(logits, tokens, tp_group, with_entropy=False, entropy_no_grad=False, chunk_size=-1):
        calls.append(entropy_no_grad)
        return "original"

    # a non-default value for a parameter the adapter does not know: slime's own function runs
    assert calculate_log_probs_and_entropy_wrapper(fork_used, None, (logits, tokens, None, True, True),
                                                   {}) == "original"
    assert calls == [True]


def test_registry_patch_replaces_both_slime_names(slime_standin):
    import slime.backends.megatron_utils.loss
    import slime.utils.ppo_utils

    from megatron_rl_patches.integrations import default_registry

    registry = default_registry()
    modules = {module.__name__: module for module in (slime.utils.ppo_utils, slime.backends.megatron_utils.loss)}
    logits, tokens, *_ = make(T=4, V=7)
    try:
        statuses = registry.apply(only="slime_logprobs", strict=True)
        # the adapter's two targets (the student-mode records on slime's callers wait for their modules)
        assert {s.status for s in statuses if s.target.endswith(":calculate_log_probs_and_entropy")} == {"applied"}
        for name in ("slime.utils.ppo_utils", "slime.backends.megatron_utils.loss"):
            lp, ent = modules[name].calculate_log_probs_and_entropy(logits, tokens, None, with_entropy=True)
            expected = calculate_log_probs_and_entropy(logits, tokens, None, with_entropy=True)
            torch.testing.assert_close(lp, expected[0], rtol=0, atol=0)
    finally:
        registry.revert("slime_logprobs")
    for module in modules.values():
        assert module.calculate_log_probs_and_entropy(logits, tokens, None) == slime.utils.ppo_utils.SLIMES_OWN


def test_importing_the_integration_stays_light():
    """The module (and its package, whose records are read at start-up) import torch only inside the functions."""
    source = open(slime_integration.__file__).read()
    header = source.split("\ndef ", 1)[0]
    assert "import torch" not in header
