"""topk_logprobs' gradient when the tail lies far below the ids (a confident fp32 policy): the
tail's own exp must not overflow at the ids' columns (inf·0 = NaN), and the gradient matches the
float64 reference."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.ops.topk import topk_kl, topk_logprobs


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


def test_topk_kl_reads_a_confident_teachers_given_tail_not_one_derived_from_its_ids():
    """A teacher whose k ids hold all but ~1e-15 of its mass: its exact tail (from topk_logprobs) is
    finite, while a tail derived from its fp32 log-probs is log(1 - 1) = -inf. The reverse KL reads
    the given tail: finite and the float64 value (a teacher_tail dropped on the way gives inf)."""
    g = torch.Generator().manual_seed(5)
    student_logits, teacher_logits = torch.randn(8, 300, generator=g), torch.randn(8, 300, generator=g)
    ids = torch.topk(teacher_logits, 4, dim=1).indices
    teacher_logits.scatter_add_(1, ids, torch.full((8, 4), 40.0))
    s_lp, s_tail = topk_logprobs(student_logits, ids)
    t_lp, t_tail = topk_logprobs(teacher_logits, ids)

    def buckets(logits):
        log_p = torch.log_softmax(logits.double(), dim=1)
        return torch.cat([log_p.gather(1, ids), log_p.scatter(1, ids, float("-inf")).logsumexp(1, keepdim=True)], 1)

    s, t = buckets(student_logits), buckets(teacher_logits)
    reference = (s.exp() * (s - t)).sum(1)
    kl = topk_kl(s_lp, s_tail, t_lp, t_tail, divergence="reverse_kl")
    assert bool(torch.isfinite(t_tail).all()) and bool((t_tail < -30).all())
    torch.testing.assert_close(kl.double(), reference, rtol=1e-5, atol=1e-5)
