"""topk_logprobs' gradient when the tail lies far below the ids (a confident fp32 policy): the
tail's own exp must not overflow at the ids' columns (inf·0 = NaN), and the gradient matches the
float64 reference."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.ops.topk import topk_logprobs


def _reference_grad(logits, ids, g_lp, g_tail, tau):
    x = logits.double().clone().requires_grad_()
    log_p = torch.log_softmax(x / tau, dim=1)
    tail = log_p.scatter(1, ids, float("-inf")).logsumexp(dim=1)
    torch.autograd.backward([log_p.gather(1, ids), tail], [g_lp.double(), g_tail.double()])
    return x.grad


@pytest.mark.parametrize("gap", [30.0, 120.0, 400.0])
def test_far_tail_gradient_is_finite_and_matches_float64(gap):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 300, generator=g)
    ids = torch.topk(logits, 4, dim=1).indices
    logits.scatter_add_(1, ids, torch.full((16, 4), gap))
    g_lp, g_tail = torch.randn(16, 4, generator=g), torch.randn(16, generator=g)
    x = logits.clone().requires_grad_()
    lp, tail = topk_logprobs(x, ids, temperature=0.9, chunk_size=5)
    torch.autograd.backward([lp, tail], [g_lp, g_tail])
    ref = _reference_grad(logits, ids, g_lp, g_tail, 0.9)
    assert torch.isfinite(x.grad).all()
    assert ((x.grad.double() - ref).abs() / ref.abs().clamp_min(1.0)).max() < 8 * 2.0**-23
