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
