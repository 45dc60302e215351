"""Non-reentrant checkpointing of a loss: same gradients, recomputation, kwargs / no-grad inputs."""
from __future__ import annotations

import torch

from megatron_rl_patches.ops.checkpoint import checkpoint_loss, checkpointed
from megatron_rl_patches.ops.logprobs import log_probs_and_entropy


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(8, 30, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(30, 8, generator=g))
    hidden = torch.randn(12, 8, generator=g)  # does not require grad: only the head's weight does
    tokens = torch.randint(0, 30, (12,), generator=g)
    weights = torch.randn(12, generator=g)
    return head, hidden, tokens, weights


def test_gradients_match_plain_call_with_kwargs_non_tensor_args_and_no_grad_inputs():
    head, hidden, tokens, weights = _setup()
    calls = []

    def loss_fn(h, toks, *, scale, temperature=1.0, weights):
        calls.append(1)
        lp, ent = log_probs_and_entropy(head(h), toks, temperature=temperature, with_entropy=True)
        return -(lp * weights).sum() * scale + 0.01 * ent.sum()

    plain = loss_fn(hidden, tokens, scale=2.0, temperature=0.7, weights=weights)
    (expected,) = torch.autograd.grad(plain, head.weight)

    calls.clear()
    loss = checkpoint_loss(loss_fn, hidden, tokens, scale=2.0, temperature=0.7, weights=weights)
    assert calls == [1]
    (got,) = torch.autograd.grad(loss, head.weight)
    assert calls == [1, 1]  # the forward ran again during backward
    torch.testing.assert_close(loss, plain)
    torch.testing.assert_close(got, expected)


def test_activations_are_not_kept_between_forward_and_backward():
    head, hidden, tokens, weights = _setup(1)
    packed = []

    def count(t):
        packed.append(t.numel())
        return t

    def loss_fn(h):
        return (head(h).softmax(-1) * 2).sum()

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        checkpoint_loss(loss_fn, hidden)
    plain_saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain_saved.append(t.numel()) or t, lambda t: t):
        loss_fn(hidden)
    assert max(plain_saved) >= 12 * 30  # the plain call keeps [T, V] activations
    assert max(packed, default=0) < 12 * 30  # checkpointed: only its inputs


def test_decorator_and_no_grad_mode():
    head, hidden, tokens, weights = _setup(2)

    @checkpointed
    def loss_fn(h, toks):
        lp, _ = log_probs_and_entropy(head(h), toks)
        return -lp.sum()

    loss = loss_fn(hidden, tokens)
    loss.backward()
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0
    assert loss_fn.__name__ == "loss_fn"
    with torch.no_grad():
        assert not loss_fn(hidden, tokens).requires_grad


def test_kwargs_named_like_torch_checkpoint_options_reach_the_function():
    seen = {}

    def loss_fn(x, *, debug, use_reentrant):
        seen.update(debug=debug, use_reentrant=use_reentrant)
        return (x * 2).sum()

    x = torch.ones(3, requires_grad=True)
    checkpoint_loss(loss_fn, x, debug="mine", use_reentrant="mine too").backward()
    assert seen == {"debug": "mine", "use_reentrant": "mine too"}
    assert torch.equal(x.grad, torch.full((3,), 2.0))
