"""One `teacher_weights` policy for `topk_kl`, `topk_opd_loss` and `lm_head_divergence` (issue 28
item 5, issue 29 defects 4-5): the weights are the mixture's probabilities (finite, >= 0, summing
to 1 within 1e-6); a string is refused (not read as digits), an iterator is read once; `topk_kl`'s
old silent renormalization of a sum != 1 keeps working for one release with a FutureWarning."""
from __future__ import annotations

import warnings

import pytest
import torch

from megatron_rl_patches import lm_head_divergence, topk_kl, topk_opd_loss

T, K, H, V = 5, 3, 4, 12


def _buckets(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(3, T, K + 1, generator=g, dtype=torch.float64), -1)
    return logp[0, :, :K], logp[0, :, K], logp[1:, :, :K], logp[1:, :, K]


def _topk_kl(weights):
    student, tail, teachers, teacher_tails = _buckets()
    return topk_kl(student, tail, teachers, teacher_tails, teacher_weights=weights)


def _topk_opd_loss(weights):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (T, K), generator=g)
    teachers = torch.log_softmax(torch.randn(2, T, V, generator=g, dtype=torch.float64), -1).gather(
        2, ids.expand(2, T, K))
    return topk_opd_loss(logits, ids, teachers, teacher_weights=weights)


def _lm_head_divergence(weights):
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(T, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g,
                                                                                        dtype=torch.float64)
    teachers = [torch.randn(T, H, generator=g, dtype=torch.float64) for _ in range(2)]
    teacher_weight = [torch.randn(V, H, generator=g, dtype=torch.float64) for _ in range(2)]
    return lm_head_divergence(hidden, weight, teachers, teacher_weight, teacher_weights=weights)


OPS = {"topk_kl": _topk_kl, "topk_opd_loss": _topk_opd_loss, "lm_head_divergence": _lm_head_divergence}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("weights", ["01", b"01", "0.5,0.5"])
def test_a_string_is_refused_not_read_as_digits(op, weights):
    with pytest.raises(TypeError, match="teacher_weights must be a sequence of 2 numbers or a tensor"):
        OPS[op](weights)


@pytest.mark.parametrize("op", sorted(OPS))
def test_an_iterator_is_read_once_and_counts_as_its_list(op):
    expected = OPS[op]([0.25, 0.75])
    torch.testing.assert_close(OPS[op](w for w in (0.25, 0.75)), expected, rtol=0, atol=0)
    torch.testing.assert_close(OPS[op](iter((0.25, 0.75))), expected, rtol=0, atol=0)


@pytest.mark.parametrize("op", sorted(OPS))
def test_a_bad_iterator_is_named_with_its_values(op):
    with pytest.raises(ValueError, match=r"got \[0\.5, -0\.5\]"):
        OPS[op](w for w in (0.5, -0.5))


def test_lm_head_divergence_refuses_a_sum_other_than_one_with_the_values():
    with pytest.raises(ValueError, match=r"teacher_weights must sum to 1 .*got \[0\.5, 0\.4\] \(sum 0\.9"):
        _lm_head_divergence(w for w in (0.5, 0.4))


@pytest.mark.parametrize("op", ["topk_kl", "topk_opd_loss"])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_topk_renormalizes_a_sum_other_than_one_for_one_release_with_a_future_warning(op, as_tensor):
    expected = OPS[op]([0.25, 0.75])
    weights = torch.tensor([1.0, 3.0]) if as_tensor else [1.0, 3.0]
    told = "do not sum to 1" if as_tensor else "sum to 4, not 1"
    with pytest.warns(FutureWarning, match=rf"teacher_weights {told}: .*a ValueError in the next release"):
        result = OPS[op](weights)
    torch.testing.assert_close(result, expected, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("op", sorted(OPS))
def test_weights_summing_to_one_give_no_warning(op):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OPS[op]([0.3, 0.7])
        OPS[op](torch.tensor([0.3, 0.7], dtype=torch.float64))
        OPS[op](None)
