"""hidden_output_processor and divergence_output_processor called as GPTModel calls them, with a
plain output layer (no megatron-core needed): layouts ([s, b] rows in, [b, s] out), equality with
lm_head_divergence on the same rows, per-token temperature, keep_mask and row_mask through the context, and
their named errors (at build time for options, at call time for the context)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl_patches import divergence_output_processor, hidden_output_processor, lm_head_divergence

S, B, H, H_T, V = 5, 3, 6, 7, 23


class Layer(torch.nn.Module):
    """An output layer as the processors read it: weight, no tensor parallelism."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.tp_group = None
        self.sequence_parallel = False


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    student = Layer(torch.randn(V, H, generator=g, dtype=torch.float64))
    teachers = [Layer(torch.randn(V, H_T, generator=g, dtype=torch.float64)) for _ in range(2)]
    hidden = torch.randn(S, B, H, generator=g, dtype=torch.float64, requires_grad=True)
    teacher_states = [torch.randn(S, B, H_T, generator=g, dtype=torch.float64) for _ in teachers]
    return student, teachers, hidden, teacher_states


def test_hidden_processor_returns_a_detached_batch_major_copy():
    _, teachers, _, states = _setup()
    state = states[0].clone().requires_grad_()
    out = hidden_output_processor()(hidden_states=state, output_layer=teachers[0], config=None)
    assert out.shape == (B, S, H_T) and out.is_contiguous() and not out.requires_grad
    assert torch.equal(out, state.detach().transpose(0, 1))
    state.data.zero_()  # a buffer reused by the model's next forward: the result keeps its values
    assert out.abs().sum() > 0


def test_divergence_processor_equals_the_op_on_the_rows():
    student, teachers, hidden, states = _setup()
    teacher_hidden = [hidden_output_processor()(hidden_states=s, output_layer=t) for s, t in zip(states, teachers)]
    g = torch.Generator().manual_seed(3)
    tau = torch.rand(B, S, generator=g, dtype=torch.float64) + 0.5
    keep = torch.rand(B, S, V, generator=g) > 0.3
    context = {"teacher_hidden": teacher_hidden, "teacher_weight": [t.weight.detach() for t in teachers],
               "temperature": tau, "keep_mask": keep}
    processor = divergence_output_processor(divergence="skew_reverse_kl", alpha=0.3, teacher_weights=[0.25, 0.75],
                                            temperature=0.9, chunk_size=2)
    out = processor(hidden_states=hidden, output_layer=student, output_weight=None, config=None, context=context)
    assert out.shape == (B, S)
    rows = lambda x: x.transpose(0, 1).reshape(S * B, *x.shape[2:])  # noqa: E731  [b, s, ...] -> (s, b) rows
    want = lm_head_divergence(hidden.reshape(S * B, H), student.weight, [s.reshape(S * B, H_T) for s in states],
                              [t.weight.detach() for t in teachers], divergence="skew_reverse_kl", alpha=0.3,
                              teacher_weights=[0.25, 0.75], temperature=rows(tau) * 0.9, keep_mask=rows(keep))
    assert torch.allclose(rows(out), want, rtol=1e-12, atol=1e-14)
    out.sum().backward()
    assert hidden.grad is not None and student.weight.grad is not None


def test_row_mask_in_the_context_selects_response_rows():
    student, teachers, hidden, states = _setup()
    teacher_hidden = [hidden_output_processor()(hidden_states=s, output_layer=t) for s, t in zip(states, teachers)]
    response = torch.zeros(B, S, dtype=torch.bool)
    response[:, 2:] = True
    context = {"teacher_hidden": teacher_hidden, "teacher_weight": [t.weight.detach() for t in teachers]}
    processor = divergence_output_processor(divergence="jsd")
    every = processor(hidden_states=hidden, output_layer=student, context=context)
    out = processor(hidden_states=hidden, output_layer=student, context={**context, "row_mask": response})
    assert torch.equal(out[response], every[response]) and not out[~response].any()
    out.sum().backward()
    assert not hidden.grad.transpose(0, 1)[~response].any() and hidden.grad.transpose(0, 1)[response].abs().sum() > 0


def test_one_teacher_as_tensors():
    student, teachers, hidden, states = _setup()
    t_hidden = states[0].transpose(0, 1)
    out = divergence_output_processor(divergence="tv")(
        hidden_states=hidden, output_layer=student,
        context={"teacher_hidden": t_hidden, "teacher_weight": teachers[0].weight.detach()})
    want = lm_head_divergence(hidden.reshape(S * B, H), student.weight, states[0].reshape(S * B, H_T),
                              teachers[0].weight.detach(), divergence="tv")
    assert torch.allclose(out.transpose(0, 1).reshape(-1), want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("options,error,message", [
    ({"divergence": "kl"}, ValueError, "unknown divergence"),
    ({"divergence": "jsd", "beta": 2.0}, ValueError, "beta must be in"),
    ({"alpha": 1.0}, ValueError, "alpha must be in"),
    ({"temperature": 0.0}, ValueError, "temperature"),
    ({"chunk_size": 0}, ValueError, "chunk_size"),
])
def test_options_are_checked_when_built(options, error, message):
    with pytest.raises(error, match=message):
        divergence_output_processor(**options)


def test_context_errors_are_named():
    student, teachers, hidden, states = _setup()
    process = divergence_output_processor()
    good = {"teacher_hidden": states[0].transpose(0, 1), "teacher_weight": teachers[0].weight.detach()}
    with pytest.raises(ValueError, match="needs output_processor_context"):
        process(hidden_states=hidden, output_layer=student, context=None)
    with pytest.raises(ValueError, match="unknown keys"):
        process(hidden_states=hidden, output_layer=student, context={**good, "ids": 1})
    with pytest.raises(ValueError, match=r"teacher_hidden'\] must be a tensor of shape \[b=3, s=5"):
        process(hidden_states=hidden, output_layer=student, context={**good, "teacher_hidden": states[0]})
    with pytest.raises(ValueError, match="share the vocabulary"):
        process(hidden_states=hidden, output_layer=student,
                context={**good, "teacher_weight": teachers[0].weight.detach()[:-1]})
    mup = SimpleNamespace(use_mup=True, mup_output_mult=2.0)
    with pytest.raises(ValueError, match="use_mup"):
        process(hidden_states=hidden, output_layer=student, context=good, config=mup)
    with pytest.raises(ValueError, match="use_mup"):
        hidden_output_processor()(hidden_states=states[0], output_layer=teachers[0], config=mup)
    assert hidden.grad is None
