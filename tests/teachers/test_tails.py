"""The tail bucket from top-k log-probs: log(1 - sum_k p) in float64, clamped at float32's epsilon."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_patches.teachers import tail_log_probs
from megatron_rl_patches.teachers.tails import TAIL_MASS_FLOOR


def test_tail_equals_float64_complement():
    gen = torch.Generator().manual_seed(0)
    full = torch.log_softmax(torch.randn(6, 50, generator=gen, dtype=torch.float64) * 3, dim=-1)
    top = full.topk(5).values
    expected = torch.log(1 - top.exp().sum(-1))
    got = tail_log_probs(top.float())  # what an engine sends: fp32 values
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.exp(), expected.exp(), rtol=0, atol=1e-6)


def test_a_mass_that_rounds_to_one_stays_finite():
    whole = torch.tensor([[0.0, -30.0], [math.log(0.5), math.log(0.5) + 1e-7]], dtype=torch.float64)
    got = tail_log_probs(whole)
    assert torch.isfinite(got).all()
    assert torch.equal(got, torch.full((2,), math.log(TAIL_MASS_FLOOR), dtype=torch.float64))
    # negative control: a tail far from the floor keeps its value
    quarter = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    assert tail_log_probs(quarter).item() == pytest.approx(math.log(0.75), abs=1e-15)
