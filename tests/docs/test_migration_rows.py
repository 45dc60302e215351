"""docs/distillation.md's migration table, one test per row (issue 29, "Migration made explicit"):
each peer's loss re-implemented in a few lines of float64 from its published definition, against
the package call the table names, on random inputs. The table must name each call it documents."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_rl_patches import lm_head_divergence, topk_kl, topk_logprobs, topk_opd_loss

DOCS = Path(__file__).resolve().parents[2] / "docs" / "distillation.md"
B, S, V, K = 2, 5, 24, 6
T = B * S


def _logits(seed: int, scale: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, V, generator=g, dtype=torch.float64) * scale,
            torch.randn(T, V, generator=g, dtype=torch.float64) * scale)


def _full_vocab(student: torch.Tensor, teacher: torch.Tensor, **options) -> torch.Tensor:
    """The package's full-vocabulary divergence on given logits: hidden = the logits, weight = I."""
    eye = torch.eye(V, dtype=torch.float64)
    return lm_head_divergence(student, eye, teacher, eye, **options)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p‖q) per row, 0·log 0 = 0."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


def _teacher_topk(teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_q = torch.log_softmax(teacher_logits, -1)
    ids = log_q.topk(K, -1).indices
    return ids, log_q.gather(-1, ids)


# --------------------------------------------------------------------- TRL: generalized_jsd_loss


def trl_generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's GKD loss as GKDTrainer calls it: temperature 1 (GKDConfig.temperature is used for
    sampling, not here), β the teacher's weight in the mixture, β = 0 forward and β = 1 reverse KL,
    "batchmean": the sum over tokens and vocabulary divided by the number of tokens."""
    log_s, log_t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    if beta == 0:
        per_token = _kl(log_t, log_s)
    elif beta == 1:
        per_token = _kl(log_s, log_t)
    else:
        log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log(1 - beta))
        per_token = beta * _kl(log_t, log_m) + (1 - beta) * _kl(log_s, log_m)
    return per_token.sum() / per_token.numel()


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_trl_generalized_jsd_is_jsd_with_beta_at_tau_one_averaged_over_tokens(beta):
    student, teacher = _logits(1)
    ours = _full_vocab(student, teacher, divergence="jsd", beta=beta).mean()
    torch.testing.assert_close(ours, trl_generalized_jsd(student, teacher, beta), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------- verl: compute_forward_kl_topk


def verl_forward_kl_topk(student: torch.Tensor, teacher_ids: torch.Tensor, teacher_topk: torch.Tensor,
                         clamp: float = -10.0) -> torch.Tensor:
    """verl 0.9's top-k distillation loss per token: the forward KL summed over the teacher's
    top-k ids only (no tail bucket), log-probs floored at `clamp`, the result floored at 0."""
    log_p = torch.log_softmax(student, -1).gather(-1, teacher_ids).clamp_min(clamp)
    log_q = teacher_topk.clamp_min(clamp)
    return (log_q.exp() * (log_q - log_p)).sum(-1).clamp_min(0.0)


@pytest.mark.parametrize("sharper_student", [False, True])
def test_verl_topk_kl_is_forward_kl_over_the_teachers_ids_with_an_empty_teacher_tail_floored_at_zero(
        sharper_student):
    student, teacher = _logits(2, scale=1.0)  # log-probs at the ids above verl's clamp: it does not bite
    if sharper_student:  # more mass than the teacher on the teacher's ids: the sum goes below 0
        student = teacher * 1.8
    ids, teacher_lp = _teacher_topk(teacher)
    at_ids = torch.log_softmax(student, -1).gather(-1, ids)
    assert float(at_ids.min()) > -10 and float(teacher_lp.min()) > -10
    empty_tail = torch.full((T,), -math.inf, dtype=torch.float64)
    ours = topk_opd_loss(student, ids, teacher_lp, empty_tail, divergence="forward_kl").clamp_min(0)
    reference = verl_forward_kl_topk(student, ids, teacher_lp)
    torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-12)
    assert bool((reference == 0).all()) == sharper_student  # verl's floor, where its sum is negative


# --------------------------------------------------------------------- NeMo-RL: DistillationLossFn


def nemo_rl_topk_kl(student: torch.Tensor, teacher_ids: torch.Tensor, teacher_topk: torch.Tensor,
                    mixed_kl_weight: float = 0.5) -> torch.Tensor:
    """NeMo-RL's default top-k distillation loss per token (kl_type "mixed", zero_outside_topk
    False): both distributions cut to the teacher's top-k ids and renormalized there, no tail,
    w·forward + (1 − w)·reverse KL."""
    log_p = torch.log_softmax(torch.log_softmax(student, -1).gather(-1, teacher_ids), -1)
    log_q = torch.log_softmax(teacher_topk, -1)
    return mixed_kl_weight * _kl(log_q, log_p) + (1 - mixed_kl_weight) * _kl(log_p, log_q)


@pytest.mark.parametrize("weight", [0.5, 0.2])
def test_nemo_rl_topk_loss_is_mixed_kl_renormalized_over_the_teachers_ids(weight):
    student, teacher = _logits(3)
    ids, teacher_lp = _teacher_topk(teacher)
    student_lp, student_tail = topk_logprobs(student, ids)
    ours = topk_kl(student_lp, student_tail, teacher_lp, divergence="mixed_kl", beta=1 - weight, renormalize=True)
    torch.testing.assert_close(ours, nemo_rl_topk_kl(student, ids, teacher_lp, weight), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------- DistiLLM: skew KLs, js_distance


def _distillm_mixture(first: torch.Tensor, second: torch.Tensor, share: float) -> torch.Tensor:
    return torch.log(share * first.exp() + (1 - share) * second.exp())


def distillm_skewed_forward_kl(student: torch.Tensor, teacher: torch.Tensor, lam: float) -> torch.Tensor:
    """DistiLLM's skewed forward KL, mean over tokens: −Σ p_t·log(λ·p_t + (1 − λ)·p_s) (it leaves
    out the teacher's Σ p_t·log p_t, constant in the student)."""
    log_s, log_t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    return -(log_t.exp() * _distillm_mixture(log_t, log_s, lam)).sum(-1).mean()


def distillm_skewed_reverse_kl(student: torch.Tensor, teacher: torch.Tensor, lam: float) -> torch.Tensor:
    """DistiLLM's skewed reverse KL, mean over tokens: KL(p_s ‖ λ·p_s + (1 − λ)·p_t)."""
    log_s, log_t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    return _kl(log_s, _distillm_mixture(log_s, log_t, lam)).mean()


def distillm_js_distance(student: torch.Tensor, teacher: torch.Tensor, lam: float) -> torch.Tensor:
    """DistiLLM's js_distance, mean over tokens: λ·KL(p_s‖M) + (1 − λ)·KL(p_t‖M), M = (1 − λ)·p_t + λ·p_s."""
    log_s, log_t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    log_m = _distillm_mixture(log_t, log_s, 1 - lam)
    return (lam * _kl(log_s, log_m) + (1 - lam) * _kl(log_t, log_m)).mean()


@pytest.mark.parametrize("lam", [0.1, 0.5])
def test_distillm_skew_kls_take_alpha_as_the_first_arguments_share(lam):
    student, teacher = _logits(4)
    log_t = torch.log_softmax(teacher, -1)
    teacher_entropy = -(log_t.exp() * log_t).sum(-1)
    forward = _full_vocab(student, teacher, divergence="skew_forward_kl", alpha=lam)
    torch.testing.assert_close((forward + teacher_entropy).mean(), distillm_skewed_forward_kl(student, teacher, lam),
                               rtol=1e-10, atol=1e-12)
    reverse = _full_vocab(student, teacher, divergence="skew_reverse_kl", alpha=lam).mean()
    torch.testing.assert_close(reverse, distillm_skewed_reverse_kl(student, teacher, lam), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lam", [0.1, 0.9])
def test_distillm_js_distance_is_jsd_with_beta_one_minus_lambda(lam):
    student, teacher = _logits(5)
    ours = _full_vocab(student, teacher, divergence="jsd", beta=1 - lam).mean()
    torch.testing.assert_close(ours, distillm_js_distance(student, teacher, lam), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------- the table names these calls


def test_the_migration_table_names_each_tested_call():
    text = DOCS.read_text()
    table = text.split("## Migrating from TRL, verl, NeMo-RL and DistiLLM", 1)[1].split("\n## ", 1)[0]
    for needle in ('divergence="jsd", beta=β', "temperature=1.0", ".mean()",
                   'divergence="forward_kl"', "teacher's top-k ids", "-inf", "clamp_min(0)",
                   'divergence="mixed_kl", beta=1 - w', "renormalize=True",
                   'divergence="skew_forward_kl", alpha=λ', 'divergence="skew_reverse_kl", alpha=λ',
                   'divergence="jsd", beta=1 - λ'):
        assert needle in table, needle
