"""megatron_rl_patches.testing.compare: the relative error sees a change at the reference's scale,
gradients are collected by name and zeroed, and gradients of other parameters are refused."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.testing.compare import close, collect_grads, grad_error, relative_error


def test_relative_error_is_scaled_by_the_reference_with_a_floor():
    want = torch.tensor([4.0, -8.0])
    assert relative_error(want + torch.tensor([0.0, 0.8]), want) == pytest.approx(0.1)
    small = torch.tensor([0.01, 0.02])
    assert relative_error(small + 0.01, small) == pytest.approx(0.01)  # floor 1: an absolute error
    assert relative_error(small + 0.01, small, floor=0.0) == pytest.approx(0.5)
    assert relative_error(torch.empty(0), torch.empty(0)) == 0.0


def test_close_wants_the_shape_and_the_tolerance():
    want = torch.ones(2, 3)
    assert close(want + 1e-7, want, 1e-6)
    assert not close(want + 1e-3, want, 1e-6)
    assert not close(want.reshape(3, 2), want, 1.0)


def test_collect_grads_copies_by_name_and_zeroes():
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    grads = collect_grads(model)
    assert set(grads) == {"weight", "bias"} and torch.equal(grads["bias"], torch.ones(2))
    assert all(p.grad is None for p in model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    kept = collect_grads(model, zero=False)
    assert model.bias.grad is not None and kept["bias"] is not model.bias.grad


def test_grad_error_takes_the_worst_parameter_and_refuses_other_names():
    want = {"a": torch.ones(2), "b": torch.full((2,), 2.0)}
    got = {"a": torch.ones(2), "b": torch.full((2,), 2.5)}
    assert grad_error(got, want) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="other parameters"):
        grad_error({"a": torch.ones(2)}, want)
    with pytest.raises(ValueError):
        grad_error({}, {})
