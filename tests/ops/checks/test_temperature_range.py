"""Issue 19, defect 12: a temperature beyond the float range (a huge Python int, or a Fraction) is
refused with a ValueError naming `temperature` by every op that takes one and by the output
processors, before anything runs; the caller's tensors are unchanged. Before the fix the ops
raised OverflowError ("int too large to convert to float")."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from megatron_rl_patches import (
    lm_head_log_probs_and_entropy,
    lm_head_topk_ids,
    lm_head_topk_logprobs,
    log_prob_output_processor,
    log_probs_and_entropy,
    topk_logprobs,
    topk_opd_loss,
    topk_output_processor,
)

HUGE = [10**400, -(10**400), Fraction(10**400, 3)]


def _case():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 3, generator=g, requires_grad=True)
    weight = torch.randn(6, 3, generator=g, requires_grad=True)
    logits = (hidden.detach() @ weight.detach().T).requires_grad_()
    tokens = torch.randint(0, 6, (4,), generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(4)])
    teacher = torch.log_softmax(torch.randn(4, 6, generator=g), -1).gather(1, ids)
    return hidden, weight, logits, tokens, ids, teacher


CALLS = {
    "log_probs_and_entropy": lambda h, w, z, t, i, q, tau: log_probs_and_entropy(z, t, temperature=tau),
    "topk_logprobs": lambda h, w, z, t, i, q, tau: topk_logprobs(z, i, temperature=tau),
    "topk_opd_loss": lambda h, w, z, t, i, q, tau: topk_opd_loss(z, i, q, temperature=tau),
    "lm_head_log_probs_and_entropy": lambda h, w, z, t, i, q, tau: lm_head_log_probs_and_entropy(
        h, w, t, temperature=tau),
    "lm_head_topk_ids": lambda h, w, z, t, i, q, tau: lm_head_topk_ids(h, w, 2, temperature=tau),
    "lm_head_topk_logprobs": lambda h, w, z, t, i, q, tau: lm_head_topk_logprobs(h, w, i, temperature=tau),
    "log_prob_output_processor": lambda h, w, z, t, i, q, tau: log_prob_output_processor(temperature=tau),
    "topk_output_processor": lambda h, w, z, t, i, q, tau: topk_output_processor(k=2, temperature=tau),
}


@pytest.mark.parametrize("tau", HUGE, ids=["1e400", "-1e400", "fraction"])
@pytest.mark.parametrize("op", sorted(CALLS))
def test_temperature_beyond_the_float_range_is_a_named_value_error(op, tau):
    tensors = _case()
    before = [t.detach().clone() for t in tensors]
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        CALLS[op](*tensors, tau)
    for t, saved in zip(tensors, before):
        assert torch.equal(t.detach(), saved) and t.grad is None


@pytest.mark.parametrize("op", sorted(CALLS))
def test_a_large_int_temperature_within_the_float_range_still_works(op):
    """The refusal is for values beyond float, not for ints: 10**6 is a legal (huge) temperature."""
    CALLS[op](*_case(), 10**6)
