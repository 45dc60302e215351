"""The divergence family, shared by the top-k + tail buckets and the full-vocabulary route.

Names (s: the student, t: the teacher or the teachers' mixture):

- ``forward_kl`` = KL(p_t‖p_s); ``reverse_kl`` = KL(p_s‖p_t);
- ``jsd`` = β·KL(p_t‖M) + (1−β)·KL(p_s‖M), M = β·p_t + (1−β)·p_s for 0 < β < 1; β = 0 is
  forward KL and β = 1 reverse KL (the generalized-JSD convention);
- ``skew_forward_kl`` = KL(p_t‖α·p_t + (1−α)·p_s); ``skew_reverse_kl`` = KL(p_s‖α·p_s + (1−α)·p_t),
  0 ≤ α < 1 (α = 0: the plain KL);
- ``tv`` = ½·Σ|p_t − p_s|.

Every one is a sum over buckets (or vocabulary columns) of an elementwise term of the two
log-probabilities (:func:`divergence_terms`), so a route sums the terms of its buckets, or of
its vocabulary tiles once every normalizer is known. Mixtures are formed in log space
(:func:`log_mixture`); 0·log 0 = 0; -inf entries give neither NaN values nor NaN gradients.
"""
from __future__ import annotations

import math
import numbers

import torch

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "skew_forward_kl", "skew_reverse_kl", "tv")
DEFAULT_DIVERGENCE = "reverse_kl"
DEFAULT_BETA = 0.5
DEFAULT_ALPHA = 0.1


def _real(name: str, value: object, meaning: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float ({meaning}), got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float ({meaning}), got {value!r}")
    return value


def check_divergence(divergence: object, beta: object = DEFAULT_BETA,
                     alpha: object = DEFAULT_ALPHA) -> tuple[str, float, float]:
    """(name, β, α) checked: TypeError for a non-string name or a non-real β/α, ValueError for an
    unknown name, a non-finite value, β outside [0, 1] or α outside [0, 1). β and α are checked
    whichever divergence is named (both have defaults), so a bad value never passes silently."""
    if not isinstance(divergence, str):
        raise TypeError(f"divergence must be a str, one of {DIVERGENCES}, got {divergence!r}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {divergence!r}; use one of {DIVERGENCES}")
    beta = _real("beta", beta, "the teacher's weight in jsd's mixture M = β·p_t + (1−β)·p_s")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta!r}")
    alpha = _real("alpha", alpha, "the skew KLs' own share in their mixture")
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1) (0: the plain KL; 1 would make the skew KL 0), got {alpha!r}")
    return divergence, beta, alpha


# ----------------------------------------------------------------------------- elementwise terms
# Internal: today's kl="mixed" form, mix·forward + (1 − mix)·reverse, reachable through the
# deprecated kl=/mix= arguments only.
MIXED_KL = "mixed_kl"


def _safe(log_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x > 0, log x with 0 standing in for -inf): where() on finite stand-ins keeps -inf entries
    out of every NaN value and NaN gradient."""
    pos = log_x > -math.inf
    return pos, torch.where(pos, log_x, 0.0)


def kl_terms(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """a·(log a − log b) per entry: 0 where a = 0 (0·log 0 = 0), +inf where b = 0 < a (no gradient)."""
    a_pos, la = _safe(log_a)
    b_pos, lb = _safe(log_b)
    terms = torch.where(a_pos & b_pos, torch.exp(la) * (la - lb), 0.0)
    return torch.where(a_pos & ~b_pos, math.inf, terms)


def log_mixture(log_a: torch.Tensor, log_b: torch.Tensor, weight_a: float) -> torch.Tensor:
    """log(w·a + (1 − w)·b) per entry, in log space (logaddexp of log a + log w and log b +
    log(1 − w)); -inf where both are 0, with no gradient there. w = 0 / 1 give log b / log a."""
    if weight_a == 0.0:
        return log_b
    if weight_a == 1.0:
        return log_a
    wa, wb = log_a + math.log(weight_a), log_b + math.log1p(-weight_a)
    empty = torch.isneginf(wa) & torch.isneginf(wb)
    mixed = torch.logaddexp(torch.where(empty, 0.0, wa), torch.where(empty, 0.0, wb))
    return torch.where(empty, -math.inf, mixed)


def plain_form(name: str, beta: float, alpha: float, mix: float = 0.5) -> str:
    """The name computed at the edge values: jsd's β = 0 / 1 are forward / reverse KL (by
    convention: the formula's limit there is 0), skew KLs with α = 0 the plain KLs, the mixed
    form with mix = 1 / 0 forward / reverse KL (so 0·inf never appears)."""
    if name == "jsd" and beta in (0.0, 1.0):
        return "forward_kl" if beta == 0.0 else "reverse_kl"
    if name in ("skew_forward_kl", "skew_reverse_kl") and alpha == 0.0:
        return name[len("skew_"):]
    if name == MIXED_KL and mix in (0.0, 1.0):
        return "forward_kl" if mix == 1.0 else "reverse_kl"
    return name


def divergence_terms(name: str, log_s: torch.Tensor, log_t: torch.Tensor, beta: float = DEFAULT_BETA,
                     alpha: float = DEFAULT_ALPHA, mix: float = 0.5) -> torch.Tensor:
    """The divergence's term per entry (bucket or vocabulary column) from normalized log-probs of
    the student `log_s` and the teacher `log_t` (same shape; the teacher detached by the caller):
    the divergence is their sum over the last dim. Arguments checked by :func:`check_divergence`.
    Edge values take the plain forms exactly (jsd's β = 0 / 1, skew α = 0, mix = 0 / 1)."""
    name = plain_form(name, beta, alpha, mix)
    if name == MIXED_KL:  # 0 < mix < 1: both terms, each finite or +inf
        return mix * kl_terms(log_t, log_s) + (1.0 - mix) * kl_terms(log_s, log_t)
    if name == "forward_kl":
        return kl_terms(log_t, log_s)
    if name == "reverse_kl":
        return kl_terms(log_s, log_t)
    if name == "jsd":
        log_m = log_mixture(log_t, log_s, beta)
        return beta * kl_terms(log_t, log_m) + (1.0 - beta) * kl_terms(log_s, log_m)
    if name == "skew_forward_kl":
        return kl_terms(log_t, log_mixture(log_t, log_s, alpha))
    if name == "skew_reverse_kl":
        return kl_terms(log_s, log_mixture(log_s, log_t, alpha))
    if name == "tv":
        return 0.5 * (torch.exp(log_t) - torch.exp(log_s)).abs()
    raise ValueError(f"unknown divergence {name!r}; use one of {DIVERGENCES}")


def bucket_divergence(name: str, log_s: torch.Tensor, log_t: torch.Tensor, beta: float = DEFAULT_BETA,
                      alpha: float = DEFAULT_ALPHA, mix: float = 0.5) -> torch.Tensor:
    """Per-row divergence between two bucket distributions [R, K] (the k ids and the tail). The
    mixed form sums each KL apart (the operation order of the recorded golden values)."""
    if plain_form(name, beta, alpha, mix) == MIXED_KL:
        return mix * kl_terms(log_t, log_s).sum(dim=-1) + (1.0 - mix) * kl_terms(log_s, log_t).sum(dim=-1)
    return divergence_terms(name, log_s, log_t, beta, alpha, mix).sum(dim=-1)


def student_log_grad_terms(name: str, log_s: torch.Tensor, log_t: torch.Tensor, beta: float = DEFAULT_BETA,
                           alpha: float = DEFAULT_ALPHA, mix: float = 0.5) -> torch.Tensor:
    """g = ∂D/∂(log p_s) per entry, the entries taken as independent; the gradient to the
    student's logits is then dD/dz_j = g_j − p_s,j·Σ_i g_i (per row, times 1/τ), what a route
    that recomputes vocabulary tiles needs. Entries with a +inf term or p_s = p_t = 0 get 0."""
    s_pos, ls = _safe(log_s)
    t_pos, lt = _safe(log_t)
    s, t = torch.where(s_pos, torch.exp(ls), 0.0), torch.where(t_pos, torch.exp(lt), 0.0)
    name = plain_form(name, beta, alpha, mix)
    reverse = torch.where(t_pos, s * (ls - lt + 1.0), 0.0)  # s·(log s − log t + 1)
    forward = torch.where(s_pos, -t, 0.0)  # −t
    if name == "forward_kl":
        return forward
    if name == "reverse_kl":
        return reverse
    if name == MIXED_KL:
        return mix * forward + (1.0 - mix) * reverse
    if name == "tv":
        return 0.5 * torch.sign(s - t) * s
    if name == "jsd":  # (1 − β)·s·(log s − log M)
        m_pos, lm = _safe(log_mixture(log_t, log_s, beta))
        return torch.where(m_pos, (1.0 - beta) * s * (ls - lm), 0.0)
    if name == "skew_forward_kl":  # −t·(1 − α)·s / M, M = α·t + (1 − α)·s
        m_pos, lm = _safe(log_mixture(log_t, log_s, alpha))
        return torch.where(m_pos & s_pos, -(1.0 - alpha) * t * torch.exp(ls - lm), 0.0)
    if name == "skew_reverse_kl":  # s·(log s − log M) + s·(1 − α)·t / M, M = α·s + (1 − α)·t
        m_pos, lm = _safe(log_mixture(log_s, log_t, alpha))
        return torch.where(m_pos, s * (ls - lm) + torch.where(t_pos, (1.0 - alpha) * s * torch.exp(lt - lm), 0.0), 0.0)
    raise ValueError(f"unknown divergence {name!r}; use one of {DIVERGENCES}")
