"""Tile math of the full-vocabulary divergences (:func:`megatron_rl_patches.lm_head_divergence`).

Notation per row: a = log p_s (the student's log-probs), b = log q (the teachers' mixture,
log q = logsumexp_j(log w_j + log p_j)), p = e^a, q = e^b, lm = log M of a divergence's own
mixture. Once every model's normalizer is known a tile's a and b are exact, and each divergence
is a row sum of an elementwise term; its gradient to the student's logits z_s is

    dD/dz_k = g_k − p_k·Σ_v g_v,   g_v = ∂(term_v)/∂a_v   (since ∂a_v/∂z_k = δ_vk − p_k),

which needs the row constants of :data:`CONSTANTS`, summed in the same pass as the value:

- forward_kl   Σ q(b − a)                      dD/dz = p − q
- reverse_kl   Σ p(a − b) = K                  dD/dz = p·(a − b − K)
- jsd          β·Σ q(b − lm) + (1−β)·K,  K = Σ p(a − lm), lm = log(β·q + (1−β)·p)
                                               dD/dz = (1−β)·p·(a − lm − K)
- skew_forward_kl  Σ q(b − lm),  lm = log(α·q + (1−α)·p),  C = Σ q·p/M
                                               dD/dz = (1−α)·p·(C − q/M)
- skew_reverse_kl  K = Σ p(a − lm),  lm = log(α·p + (1−α)·q),  C = Σ p²/M
                                               dD/dz = p·(a − lm − K − α·(p/M − C))
- tv           ½·Σ|q − p|,  C = Σ sign(q − p)·p     dD/dz = ½·p·(C − sign(q − p))

(jsd with β = 0 / 1 and the skews with α = 0 are the plain KLs and run as those:
:func:`megatron_rl_patches.ops._divergences.plain_form`.) Ids outside
keep_mask have a = b = −inf: their terms and gradients are 0, never NaN.
"""
from __future__ import annotations

import torch

from megatron_rl_patches.ops._divergences import log_mixture
from megatron_rl_patches.ops._stats import RowStats, _moved, finite_or_zero, per_row, shifted_rows

# The row constants each divergence's pass sums beside its value (what backward reads).
CONSTANTS = {"forward_kl": 0, "reverse_kl": 1, "jsd": 1, "skew_forward_kl": 1, "skew_reverse_kl": 2, "tv": 1}


def one_pass(name: str, n_teachers: int) -> bool:
    """Forward / reverse KL against one teacher need no normalizer beforehand: their cross term
    is folded with online rescaling beside the normalizers. Everything else needs a second pass."""
    return n_teachers == 1 and name in ("forward_kl", "reverse_kl")


def _zero_outside(t: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """`t` with the ids outside keep_mask set to 0 (in place); they carry −inf − (−inf) = NaN."""
    return t if kept is None else t.masked_fill_(~kept, 0.0)


# ----------------------------------------------------------------------------- pass 1: cross term


def fold_cross(cross: torch.Tensor, rows: slice, old_shift: torch.Tensor, lead: RowStats, x_lead: torch.Tensor,
               x_other: torch.Tensor, scale: float | torch.Tensor, kept: torch.Tensor | None) -> None:
    """cross[rows] ← Σ e^((x_lead − m)·s)·(x_lead − x_other)·s over the columns folded so far, m the
    lead model's running max: rescaled by e^((m_old − m_new)·s) as `lead`'s fold (already done
    for this tile, from `old_shift`) moved it, exactly as the core rescales its sums."""
    new_shift = finite_or_zero(lead.shift[rows])
    _, factor = _moved(old_shift, new_shift, per_row(scale))
    weights = shifted_rows(x_lead, new_shift, scale, out=torch.empty_like(x_lead)).exp_()
    diff = _zero_outside(torch.sub(x_lead, x_other).mul_(scale), kept)
    cross[rows] = cross[rows] * factor + torch.linalg.vecdot(weights, diff)


def one_pass_value(name: str, cross: torch.Tensor, shifts: list[torch.Tensor], log_sums: list[torch.Tensor],
                   scale: float | torch.Tensor) -> torch.Tensor:
    """KL from the folded cross term: forward KL(t‖s) = cross/S_t − (m_t − m_s)·s − log S_t + log S_s
    (cross weighted by the teacher), reverse KL likewise with the roles swapped."""
    lead, other = (1, 0) if name == "forward_kl" else (0, 1)
    return (cross * torch.exp(-log_sums[lead]) - (shifts[lead] - shifts[other]) * per_row(scale)
            - log_sums[lead] + log_sums[other])


# ----------------------------------------------------------------------------- log-probs of a tile


def log_probs_(x: torch.Tensor, shift: torch.Tensor, log_sum: torch.Tensor,
               scale: float | torch.Tensor) -> torch.Tensor:
    """x's log-probs written over x: (x − shift)·s − log S (subtract first: exact near the max)."""
    return shifted_rows(x, shift, scale, out=x).sub_(log_sum[:, None])


def mixture_(log_ps: list[torch.Tensor], log_w: torch.Tensor) -> torch.Tensor:
    """log q = logsumexp_j(log w_j + log p_j), written over the first teacher's tile."""
    if len(log_ps) == 1:
        return log_ps[0]
    out = log_ps[0].add_(log_w[0])
    for j, lp in enumerate(log_ps[1:], start=1):
        torch.logaddexp(out, lp.add_(log_w[j]), out=out)
    return out


# ----------------------------------------------------------------------------- pass 2: row sums


def row_sums(name: str, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float,
             kept: torch.Tensor | None) -> list[torch.Tensor]:
    """[value, constants...] summed over the tile's columns, each [r] (see the module docstring)."""
    dot = torch.linalg.vecdot
    if name == "forward_kl":
        return [dot(b.exp(), _zero_outside(b - a, kept))]
    if name == "reverse_kl":
        kl = dot(a.exp(), _zero_outside(a - b, kept))
        return [kl, kl]
    if name == "tv":
        p, q = a.exp(), b.exp()
        return [0.5 * (q - p).abs_().sum(dim=1), dot(torch.sign(q - p), p)]
    if name == "jsd":
        lm = log_mixture(b, a, beta)
        k = dot(a.exp(), _zero_outside(a - lm, kept))
        return [beta * dot(b.exp(), _zero_outside(b - lm, kept)) + (1 - beta) * k, k]
    if name == "skew_forward_kl":
        lm = log_mixture(b, a, alpha)
        c = _zero_outside((a + b - lm).exp_(), kept).sum(dim=1)  # Σ q·p/M
        return [dot(b.exp(), _zero_outside(b - lm, kept)), c]
    lm = log_mixture(a, b, alpha)  # skew_reverse_kl
    k = dot(a.exp(), _zero_outside(a - lm, kept))
    return [k, k, _zero_outside((2 * a - lm).exp_(), kept).sum(dim=1)]  # Σ p²/M


# ----------------------------------------------------------------------------- backward


def student_grad(name: str, a: torch.Tensor, b: torch.Tensor, consts: list[torch.Tensor], beta: float, alpha: float,
                 kept: torch.Tensor | None) -> torch.Tensor:
    """dD/dz_s of the tile [r, c] (consts: the row constants of :func:`row_sums`, each [r])."""
    c0 = consts[0][:, None] if consts else None
    p = a.exp()
    if name == "forward_kl":
        return p.sub_(b.exp())
    assert c0 is not None  # every other divergence has row constants
    if name == "reverse_kl":
        return p.mul_(_zero_outside((a - b).sub_(c0), kept))
    if name == "jsd":
        lm = log_mixture(b, a, beta)
        return p.mul_(_zero_outside((a - lm).sub_(c0), kept)).mul_(1 - beta)
    if name == "skew_forward_kl":
        lm = log_mixture(b, a, alpha)
        return p.mul_(_zero_outside((b - lm).exp_().neg_().add_(c0), kept)).mul_(1 - alpha)
    if name == "skew_reverse_kl":
        lm = log_mixture(a, b, alpha)
        ratio = (a - lm).exp_().sub_(consts[1][:, None]).mul_(alpha)  # α·(p/M − C)
        return p.mul_(_zero_outside((a - lm).sub_(c0).sub_(ratio), kept))
    # tv
    return p.mul_(torch.sign(b.exp().sub_(p)).neg_().add_(c0)).mul_(0.5)
