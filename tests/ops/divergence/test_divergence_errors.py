"""lm_head_divergence's named errors: mismatched vocabularies or shards, β and α out of range, an
unknown divergence, teacher weights not summing to 1, non-finite teacher hidden states — each
raised before any result, every input unchanged (values and gradients)."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_patches import lm_head_divergence
from megatron_rl_patches.ops.divergence_checks import VocabularyMismatchError

T, H, H_T, V = 6, 4, 5, 20


def _inputs():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(T, H, generator=g).requires_grad_()
    weight = torch.randn(V, H, generator=g).requires_grad_()
    teachers = [(torch.randn(T, H_T, generator=g), torch.randn(V, H_T, generator=g)) for _ in range(2)]
    return hidden, weight, teachers


def _nan_hidden(teachers):
    bad = teachers[1][0].clone()
    bad[2, 1] = math.nan
    return [teachers[0][0], bad], [t[1] for t in teachers], {}


CASES = {
    "vocabulary rows differ": (VocabularyMismatchError, "share the vocabulary",
                               lambda t: (t[0][0], t[0][1][:-2], {})),
    "one shard of several differs": (VocabularyMismatchError, r"teacher_weight\[1\]",
                                     lambda t: ([t[0][0], t[1][0]], [t[0][1], torch.randn(2 * V, H_T)], {})),
    "beta above 1": (ValueError, "beta must be in", lambda t: (t[0][0], t[0][1], {"divergence": "jsd", "beta": 1.5})),
    "beta below 0": (ValueError, "beta must be in", lambda t: (t[0][0], t[0][1], {"beta": -0.1})),
    "alpha = 1": (ValueError, "alpha must be in", lambda t: (t[0][0], t[0][1], {"alpha": 1.0})),
    "alpha below 0": (ValueError, "alpha must be in", lambda t: (t[0][0], t[0][1], {"alpha": -0.5})),
    "unknown divergence": (ValueError, "unknown divergence", lambda t: (t[0][0], t[0][1], {"divergence": "kl"})),
    "divergence not a str": (TypeError, "divergence must be a str", lambda t: (t[0][0], t[0][1], {"divergence": 1})),
    "weights sum to 0.9": (ValueError, "sum to 1", lambda t: ([x[0] for x in t], [x[1] for x in t],
                                                              {"teacher_weights": [0.5, 0.4]})),
    "tensor weights sum to 2": (ValueError, "sum to 1", lambda t: ([x[0] for x in t], [x[1] for x in t],
                                                                   {"teacher_weights": torch.tensor([1.0, 1.0])})),
    "negative weight": (ValueError, "finite and >= 0", lambda t: ([x[0] for x in t], [x[1] for x in t],
                                                           {"teacher_weights": [1.5, -0.5]})),
    "one weight per teacher": (ValueError, "one weight per teacher", lambda t: ([x[0] for x in t], [x[1] for x in t],
                                                                               {"teacher_weights": [1.0]})),
    "NaN teacher hidden": (ValueError, r"teacher_hidden\[1\] has non-finite", _nan_hidden),
    "inf teacher hidden": (ValueError, "teacher_hidden has non-finite",
                           lambda t: (t[0][0].clone().index_fill_(0, torch.tensor([3]), math.inf), t[0][1], {})),
    "hidden and weights unpaired": (ValueError, "same length", lambda t: ([t[0][0], t[1][0]], [t[0][1]], {})),
    "teacher rows differ": (ValueError, "hidden's rows", lambda t: (t[0][0][:-1], t[0][1], {})),
    "teacher H differs from its weight": (ValueError, "H_t", lambda t: (t[0][0], t[1][1][:, :-1], {})),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_named_error_and_inputs_unchanged(case):
    error, message, build = CASES[case]
    hidden, weight, teachers = _inputs()
    teacher_hidden, teacher_weight, options = build(teachers)
    everything = [hidden, weight, *teachers[0], *teachers[1]]
    everything += [t for t in ([teacher_hidden] if isinstance(teacher_hidden, torch.Tensor) else teacher_hidden)]
    before = [t.detach().clone() for t in everything]
    with pytest.raises(error, match=message):
        lm_head_divergence(hidden, weight, teacher_hidden, teacher_weight, **options)
    for t, old in zip(everything, before):
        assert torch.equal(t, old) or (torch.isnan(old).any() and torch.equal(t.isnan(), old.isnan()))
    assert hidden.grad is None and weight.grad is None


def test_student_nan_rows_are_named():
    hidden, weight, teachers = _inputs()
    bad = hidden.detach().clone()
    bad[4] = math.nan
    with pytest.raises(ValueError, match=r"lm_head_divergence: logits \(hidden @ weight.T\) rows \[4\]"):
        lm_head_divergence(bad, weight, *teachers[0])


def test_keep_mask_without_any_kept_id_is_named():
    hidden, weight, teachers = _inputs()
    keep = torch.ones(T, V, dtype=torch.bool)
    keep[1] = False
    with pytest.raises(ValueError, match=r"keep_mask keeps no vocabulary id in rows \[1\]"):
        lm_head_divergence(hidden, weight, *teachers[0], keep_mask=keep)
