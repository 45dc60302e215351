"""The one computation of a teacher's own scores from hidden states (`teachers.head.own_scores`: the
live self-teacher's and the served head route's): the actual token's log-prob, the own top-k ids with
their log-probs and the exact tail, against float64 softmax, for a token among the top-k and not, at
K = V - 1 too (the one id outside the top-k is the tail: asking it beside them would be K + 1 = V ids,
which the op refuses), at a temperature; the self-teacher and the head give the same scores."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers import TeacherHead
from megatron_rl_patches.teachers.head.own_scores import own_scores

V, H, R = 40, 8, 25


def reference(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, k: int, tau: float):
    logp = torch.log_softmax(hidden.double() @ weight.double().T / tau, dim=-1)
    values, ids = logp.topk(k, dim=-1)
    tail = torch.log1p(-values.exp().sum(-1).clamp(max=1.0)).clamp(min=-1e30)
    rest = torch.logsumexp(logp.scatter(1, ids, float("-inf")), dim=-1)
    return logp.gather(1, tokens[:, None])[:, 0], ids, values, torch.where(rest > -1e30, rest, tail)


@pytest.mark.parametrize("k", [1, 5, V - 1])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_own_scores_equal_float64_softmax(k, tau):
    gen = torch.Generator().manual_seed(k)
    weight, hidden = torch.randn(V, H, generator=gen), torch.randn(R, H, generator=gen)
    logits = hidden @ weight.T
    tokens = torch.randint(0, V, (R,), generator=gen)
    tokens[:5] = logits[:5].argmax(-1)  # some tokens among the top-k, the others mostly not
    token, ids, values, tail = own_scores(hidden, weight, tokens, k, temperature=tau)
    want_token, want_ids, want_values, want_tail = reference(hidden, weight, tokens, k, tau)
    assert torch.equal(ids, want_ids)
    assert token.dtype == values.dtype == tail.dtype == torch.float64 and ids.dtype == torch.int64
    torch.testing.assert_close(token, want_token, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(values, want_values, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(tail, want_tail, atol=2e-6, rtol=1e-6)
    head = TeacherHead(weight, V, V, 0)
    for got, own in zip(head.own_scores(hidden, tokens, k, tau), (token, ids, values, tail)):
        assert torch.equal(got, own)  # the served head route: the same function
