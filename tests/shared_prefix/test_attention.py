"""The plan's attention against each sample's own causal attention in float64 (values and the
gradients of query, key and value, grouped-query heads), both routes (FlexAttention forward-only on
CPU, as torch runs it there), a route name checked."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_patches.shared_prefix.attention import shared_prefix_attention
from megatron_rl_patches.shared_prefix.plan import plan_shared_prefix

HEADS, GROUPS, WIDTH = 4, 2, 8


def _batch(prompt: int, responses: list[int], alone: list[int], padding: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 50, (prompt,), generator=gen).tolist()
    samples = [shared + torch.randint(0, 50, (n,), generator=gen).tolist() for n in responses]
    samples += [torch.randint(50, 99, (n,), generator=gen).tolist() for n in alone]
    tokens = torch.tensor([t for s in samples for t in s] + [0] * padding)
    cu = [0]
    for s in samples:
        cu.append(cu[-1] + len(s))
    return samples, cu, plan_shared_prefix(tokens, cu, pad_to=4)


def _reference(q, k, v, plan, cu, samples, scale):
    """Each sample's own causal attention in float64, its rows gathered from the physical stream
    through the plan: [T, b, h * d] on the samples' logical rows."""
    outs = []
    for i, sample in enumerate(samples):
        rows = plan.logical_rows[cu[i]:cu[i] + len(sample)]
        qi, ki, vi = (t[rows].double().permute(1, 2, 0, 3) for t in (q, k, v))
        ki, vi = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (ki, vi))
        scores = qi @ ki.transpose(-1, -2) * scale
        scores = scores.masked_fill(~torch.ones(len(sample), len(sample), dtype=torch.bool).tril(), -math.inf)
        outs.append((scores.softmax(-1) @ vi).permute(2, 0, 1, 3).flatten(2))
    return torch.cat(outs)


@pytest.mark.parametrize(("prompt", "responses", "alone"), [
    (40, [5, 9, 3], [12]),           # a group, a sample alone
    (1, [4, 4], []),                 # a one-token prompt
    (20, [6], [7, 3]),               # a group of one: the ordinary path
    (33, [2, 5, 1, 8, 3, 2, 6, 4], []),  # G = 8
])
def test_the_mask_route_equals_each_samples_own_attention_values_and_gradients(prompt, responses, alone):
    samples, cu, plan = _batch(prompt, responses, alone)
    gen = torch.Generator().manual_seed(1)
    shape = (plan.physical_length, 2)
    q = torch.randn(*shape, HEADS, WIDTH, generator=gen, requires_grad=True)
    k = torch.randn(*shape, GROUPS, WIDTH, generator=gen, requires_grad=True)
    v = torch.randn(*shape, GROUPS, WIDTH, generator=gen, requires_grad=True)
    scale = 0.3
    out = shared_prefix_attention(q, k, v, plan, scale=scale, route="mask")
    assert out.shape == (plan.physical_length, 2, HEADS * WIDTH)
    logical = plan.logical_rows[:cu[-1]]
    got = out[logical]
    want = _reference(q, k, v, plan, cu, samples, scale)
    assert (got.double() - want).abs().max() < 1e-6
    weights = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    (got.double() * weights).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (want * weights).sum().backward()
    for got_grad, t in zip(grads, (q, k, v)):
        assert (got_grad.double() - t.grad.double()).abs().max() < 1e-5 * max(1.0, float(t.grad.abs().max()))


def test_the_flex_route_equals_the_mask_route_without_gradients_on_cpu():
    pytest.importorskip("torch.nn.attention.flex_attention")
    samples, cu, plan = _batch(37, [4, 7, 2], [9], padding=2)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(plan.physical_length, 1, HEADS, WIDTH, generator=gen)
    k, v = (torch.randn(plan.physical_length, 1, GROUPS, WIDTH, generator=gen) for _ in range(2))
    with pytest.warns(UserWarning, match="without torch.compile"):
        flex = shared_prefix_attention(q, k, v, plan, scale=0.25, route="flex")
    mask = shared_prefix_attention(q, k, v, plan, scale=0.25, route="mask")
    rows = plan.logical_rows[:cu[-1]]
    assert (flex[rows] - mask[rows]).abs().max() < 1e-5


def test_megatrons_squeezed_packed_layout_and_a_bad_route():
    samples, cu, plan = _batch(5, [2, 3], [])
    q = torch.randn(plan.physical_length, HEADS, WIDTH)
    k, v = torch.randn(plan.physical_length, GROUPS, WIDTH), torch.randn(plan.physical_length, GROUPS, WIDTH)
    out = shared_prefix_attention(q, k, v, plan, scale=0.5)
    assert out.shape == (plan.physical_length, 1, HEADS * WIDTH)
    with pytest.raises(ValueError, match="route must be one of auto, mask, flex"):
        shared_prefix_attention(q, k, v, plan, scale=0.5, route="dense")
    with pytest.raises(ValueError, match="the plan's stream"):
        shared_prefix_attention(q[:-1], k[:-1], v[:-1], plan, scale=0.5)
