"""The divergence family: ONE table row per divergence, evaluated by the top-k + tail buckets and
by the full-vocabulary tiles alike.

Names (s: the student, t: the teacher or the teachers' mixture):

- ``forward_kl`` = KL(p_t‖p_s); ``reverse_kl`` = KL(p_s‖p_t);
- ``mixed_kl`` = (1−β)·KL(p_t‖p_s) + β·KL(p_s‖p_t), β the reverse KL's share (NeMo-RL's default
  top-k loss is β = 0.5 with ``renormalize=True``);
- ``jsd`` = β·KL(p_t‖M) + (1−β)·KL(p_s‖M), M = β·p_t + (1−β)·p_s for 0 < β < 1;
- ``skew_forward_kl`` = KL(p_t‖α·p_t + (1−α)·p_s); ``skew_reverse_kl`` = KL(p_s‖α·p_s + (1−α)·p_t),
  0 ≤ α < 1 (α = 0: the plain KL);
- ``tv`` = ½·Σ|p_t − p_s|.

β = 0 is forward KL and β = 1 reverse KL for both β-divergences (the generalized-JSD
convention). A row's :attr:`Divergence.formula` gives, from the normalized log-probs a = log p_s
and b = log q of some entries (buckets or vocabulary columns), the divergence's terms per entry
(as weighted parts, each summed apart) and its gradient terms g = ∂D/∂a per entry, up to a
multiple of p (which the softmax cancels). The gradient to the student's logits is then, per row
and times 1/τ, dD/dz = g − p·G with the row constant G = Σ g (:attr:`Divergence.constant`).
0·log 0 = 0; -inf entries give neither NaN values nor NaN gradients (:data:`SAFE`).

To add a divergence: one row in :data:`TABLE` (its formula: the terms per entry and g; how G is
known; its parameter), which names it everywhere (:data:`DIVERGENCES` is the table's order; the
slime settings and `bench distill` read it), its edge values in :func:`plain_form` if any, a
float64 definition in ``megatron_rl_patches/testing/divergence_reference.py``; and, for the Triton
kernels to take it, a branch of ``entry_terms`` and its name in ``KERNEL_DIVERGENCES`` beside it
(ops/kernels/triton/_divergence.py): until then the torch tiles evaluate it on every backend.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

DEFAULT_DIVERGENCE = "reverse_kl"
DEFAULT_BETA = 0.5
DEFAULT_ALPHA = 0.1

Parts = list[tuple[float, torch.Tensor]]


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
    beta = _real("beta", beta, "jsd's teacher weight in M = β·p_t + (1−β)·p_s, mixed_kl's reverse-KL share")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta!r}")
    alpha = _real("alpha", alpha, "the skew KLs' own share in their mixture")
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1) (0: the plain KL; 1 would make the skew KL 0), got {alpha!r}")
    return divergence, beta, alpha


# ----------------------------------------------------------------------------- entry primitives
def _safe(log_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x > 0, log x with 0 standing in for -inf): where() on finite stand-ins keeps -inf entries
    out of every NaN value and NaN gradient."""
    pos = log_x > -math.inf
    return pos, torch.where(pos, log_x, 0.0)


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


def _safe_ratio(log_x: torch.Tensor, log_y: torch.Tensor, log_m: torch.Tensor) -> torch.Tensor:
    """x·y/m per entry, 0 where x or y is 0 (m > 0 there)."""
    pos = (log_x > -math.inf) & (log_y > -math.inf)
    return torch.where(pos, torch.exp(torch.where(pos, log_x + log_y - log_m, 0.0)), 0.0)


def _safe_kl(log_x: torch.Tensor, x: torch.Tensor, log_y: torch.Tensor) -> torch.Tensor:
    """x·(log x − log y) per entry (x = e^(log x) at hand): 0 where x = 0 (0·log 0 = 0), +inf
    where y = 0 < x (no gradient)."""
    x_pos, lx = _safe(log_x)
    y_pos, ly = _safe(log_y)
    terms = x * (lx - ly)  # 0 where x = 0: x is e^(log x) and both logs are finite stand-ins
    return torch.where(x_pos & ~y_pos, math.inf, terms)


@dataclass(frozen=True)
class EntryOps:
    """The entry primitives a formula is written in: :data:`SAFE` for entries that may be -inf
    (buckets, masked ids), :data:`FINITE` for tiles whose log-probs are all finite (fewer passes)."""

    kl: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # x·(log x − log y), x given
    mix: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # log(w·x + (1 − w)·y)
    ratio: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # x·y/m


SAFE = EntryOps(kl=_safe_kl, mix=log_mixture, ratio=_safe_ratio)
FINITE = EntryOps(
    kl=lambda lx, x, ly: torch.sub(lx, ly).mul_(x),
    mix=lambda lx, ly, w: torch.logaddexp(lx + math.log(w), ly + math.log1p(-w)),
    ratio=lambda lx, ly, lm: torch.add(lx, ly).sub_(lm).exp_(),
)


class Entries:
    """The log-probs a (student) and b (teacher) of some entries, with p = e^a and q = e^b made
    once on first use (a formula may need either, both, or neither)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, ops: EntryOps) -> None:
        self.a, self.b, self.ops = a, b, ops
        self._p: torch.Tensor | None = None
        self._q: torch.Tensor | None = None

    @property
    def p(self) -> torch.Tensor:
        if self._p is None:
            self._p = torch.exp(self.a)
        return self._p

    @property
    def q(self) -> torch.Tensor:
        if self._q is None:
            self._q = torch.exp(self.b)
        return self._q


# ----------------------------------------------------------------------------- the table
Formula = Callable[[Entries, float, bool, bool], tuple[Parts, torch.Tensor | None]]


@dataclass(frozen=True)
class Divergence:
    """One row of the table: `formula(entries, w, value, grad)` → (the terms as weighted parts,
    empty when not `value`; the gradient terms g, None when not `grad`), w the row's
    `parameter` (β, α or unused). `constant`: how a route knows G = Σ g: ``"sum"`` (summed beside
    the value), ``"zero"`` (g sums to 0 by construction), ``"value"`` (G is the divergence itself)."""

    name: str
    parameter: str | None
    formula: Formula
    constant: str


def _forward(e: Entries, w, value, grad):
    return ([(1.0, e.ops.kl(e.b, e.q, e.a))] if value else []), (e.p - e.q if grad else None)  # −q, plus p


def _reverse(e: Entries, w, value, grad):
    k = e.ops.kl(e.a, e.p, e.b)  # p·(a − b): the term, and ∂/∂a minus p
    return ([(1.0, k)] if value else []), (k if grad else None)


def _mixed(e: Entries, beta, value, grad):
    rev = e.ops.kl(e.a, e.p, e.b)
    g = torch.sub(e.p, e.q).mul_(1.0 - beta).add_(rev, alpha=beta) if grad else None
    return ([(1.0 - beta, e.ops.kl(e.b, e.q, e.a)), (beta, rev)] if value else []), g


def _jsd(e: Entries, beta, value, grad):
    lm = e.ops.mix(e.b, e.a, beta)
    k = e.ops.kl(e.a, e.p, lm)  # ∂/∂a of the whole: (1 − β)·p·(a − lm), plus a multiple of p
    return ([(beta, e.ops.kl(e.b, e.q, lm)), (1.0 - beta, k)] if value else []), (k.mul(1.0 - beta) if grad else None)


def _skew_forward(e: Entries, alpha, value, grad):
    lm = e.ops.mix(e.b, e.a, alpha)
    g = e.ops.ratio(e.b, e.a, lm).mul_(alpha - 1.0) if grad else None  # −(1 − α)·q·p/M
    return ([(1.0, e.ops.kl(e.b, e.q, lm))] if value else []), g


def _skew_reverse(e: Entries, alpha, value, grad):
    lm = e.ops.mix(e.a, e.b, alpha)
    k = e.ops.kl(e.a, e.p, lm)  # + (1 − α)·p·q/M
    return ([(1.0, k)] if value else []), (k.add(e.ops.ratio(e.a, e.b, lm), alpha=1.0 - alpha) if grad else None)


def _tv(e: Entries, w, value, grad):
    diff = e.p - e.q
    g = torch.sign(diff).mul_(e.p).mul_(0.5) if grad else None
    return ([(0.5, diff.abs_())] if value else []), g


TABLE = {row.name: row for row in (
    Divergence("forward_kl", None, _forward, "zero"),
    Divergence("reverse_kl", None, _reverse, "value"),
    Divergence("mixed_kl", "beta", _mixed, "sum"),
    Divergence("jsd", "beta", _jsd, "sum"),
    Divergence("skew_forward_kl", "alpha", _skew_forward, "sum"),
    Divergence("skew_reverse_kl", "alpha", _skew_reverse, "sum"),
    Divergence("tv", None, _tv, "sum"),
)}
DIVERGENCES = tuple(TABLE)  # every divergence the ops take, in the table's order


def plain_form(name: str, beta: float, alpha: float) -> str:
    """The name computed at the edge values: jsd's and mixed_kl's β = 0 / 1 are forward / reverse
    KL (for jsd by convention: the formula's limit there is 0), skew KLs with α = 0 the plain KLs
    (so 0·inf never appears)."""
    if name in ("jsd", "mixed_kl") and beta in (0.0, 1.0):
        return "forward_kl" if beta == 0.0 else "reverse_kl"
    if name in ("skew_forward_kl", "skew_reverse_kl") and alpha == 0.0:
        return name[len("skew_"):]
    return name


@dataclass(frozen=True)
class ResolvedDivergence:
    """A checked divergence choice at its plain form: the table row and its parameter's value."""

    row: Divergence
    weight: float

    @classmethod
    def of(cls, name: str, beta: float = DEFAULT_BETA, alpha: float = DEFAULT_ALPHA) -> ResolvedDivergence:
        row = TABLE[plain_form(name, beta, alpha)]
        return cls(row, beta if row.parameter == "beta" else alpha if row.parameter == "alpha" else 0.0)

    def parts(self, e: Entries) -> Parts:
        return self.row.formula(e, self.weight, True, False)[0]

    def grad_terms(self, e: Entries) -> torch.Tensor:
        grad = self.row.formula(e, self.weight, False, True)[1]
        assert grad is not None  # asked for
        return grad


def sum_parts(parts: Parts) -> torch.Tensor:
    """Σ_i w_i·(Σ over the last dim of part_i): each part summed apart (the order of the golden values)."""
    total = None
    for weight, part in parts:
        s = part.sum(dim=-1)
        s = s if weight == 1.0 else weight * s
        total = s if total is None else total + s
    assert total is not None  # every row has a part
    return total


def bucket_divergence(plan: ResolvedDivergence, log_s: torch.Tensor, log_t: torch.Tensor) -> torch.Tensor:
    """Per-row divergence between two bucket distributions [R, K] (normalized log-probs, -inf
    allowed; the teacher detached by the caller); autograd gives the gradient."""
    return sum_parts(plan.parts(Entries(log_s, log_t, SAFE)))


def check_renormalize(renormalize: object) -> bool:
    """`renormalize=` of the top-k losses: True or False (TypeError naming it otherwise)."""
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be True (drop the tail, renormalize over the k ids: NeMo-RL's "
                        f"convention) or False (k ids + tail bucket), got {renormalize!r}")
    return renormalize


def renormalized(log_p: torch.Tensor) -> torch.Tensor:
    """log-probs renormalized over the last dim (NeMo-RL's top-k convention: no tail bucket)."""
    return log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
