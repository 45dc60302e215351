"""Tile math of the full-vocabulary divergences (:func:`megatron_rl_patches.lm_head_divergence`).

Notation per row: a = log p_s (the student's log-probs), b = log q (the teachers' mixture,
log q = logsumexp_j(log w_j + log p_j)), p = e^a. Once every model's normalizer is known a
tile's a and b are exact, and the divergence's table row
(:data:`megatron_rl_patches.ops._divergences.TABLE`, the same formula the top-k buckets use)
gives its terms and gradient terms g per column; the gradient to the student's logits is

    dD/dz_k = g_k − p_k·G,   G = Σ_v g_v   (since ∂a_v/∂z_k = δ_vk − p_k),

with G summed beside the value in the same pass (or known: 0 for forward KL, whose g = p − q,
and the value itself for reverse KL, whose g = p·(a − b)). Forward / reverse KL and mixed_kl
against one teacher fold their cross terms online instead (one pass). Ids outside keep_mask have
a = b = −inf: their terms and gradients are 0, never NaN (the -inf-safe primitives).
"""
from __future__ import annotations

import torch

from megatron_rl_patches.ops._divergences import FINITE, SAFE, Entries, EntryOps, ResolvedDivergence, sum_parts
from megatron_rl_patches.ops._stats import RowStats, finite_or_zero, moved, per_row, shifted_rows


def cross_leads(plan: ResolvedDivergence, n_teachers: int) -> tuple[int, ...]:
    """Whose probabilities weigh each cross term the divergence folds in pass 1 (0: the student,
    1: the teacher); () when it needs a second pass. Forward KL, reverse KL and their mixture
    mixed_kl against one teacher need no normalizer beforehand: their cross terms fold with online
    rescaling beside the normalizers (one pass, 2 of the 8 matmul-sized recomputes saved).
    Everything else (the teachers' mixture, M, |q − p|) needs a second pass."""
    if n_teachers != 1:
        return ()
    return {"forward_kl": (1,), "reverse_kl": (0,), "mixed_kl": (1, 0)}.get(plan.row.name, ())


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
    _, factor = moved(old_shift, new_shift, per_row(scale))
    weights = shifted_rows(x_lead, new_shift, scale, out=torch.empty_like(x_lead)).exp_()
    diff = torch.sub(x_lead, x_other)
    if isinstance(scale, torch.Tensor) or scale != 1.0:
        diff.mul_(scale)
    _zero_outside(diff, kept)
    cross[rows] = cross[rows] * factor + torch.linalg.vecdot(weights, diff)


def one_pass_sums(plan: ResolvedDivergence, crosses: list[torch.Tensor], shifts: list[torch.Tensor],
                  log_sums: list[torch.Tensor],
                  scale: float | torch.Tensor) -> torch.Tensor:
    """[T, n_sums] (the value, and G when the row sums it) from the folded cross terms (in
    :func:`cross_leads`' order). KL(lead‖other) = cross/S_lead − (m_lead − m_other)·s − log S_lead
    + log S_other, cross weighted by the lead's probabilities; mixed_kl = (1 − β)·forward + β·reverse,
    its G = Σ g = β·reverse (forward KL's g sums to 0)."""
    kls = []
    for cross, lead in zip(crosses, cross_leads(plan, 1)):
        other = 1 - lead
        kls.append(cross * torch.exp(-log_sums[lead]) - (shifts[lead] - shifts[other]) * per_row(scale)
                   - log_sums[lead] + log_sums[other])
    if plan.row.name != "mixed_kl":
        return kls[0][:, None]
    forward, reverse = kls
    beta = plan.weight
    return torch.stack([(1.0 - beta) * forward + beta * reverse, beta * reverse], dim=1)


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


def _ops(kept: torch.Tensor | None) -> EntryOps:
    """Masked ids are -inf in every model's tile: only then are the -inf-safe primitives needed."""
    return FINITE if kept is None else SAFE


def n_sums(plan: ResolvedDivergence) -> int:
    """How many row sums pass 2 gathers: the value, and G unless the row knows it otherwise."""
    return 2 if plan.row.constant == "sum" else 1


def row_sums(plan: ResolvedDivergence, a: torch.Tensor, b: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """[r, n_sums]: the tile's share of the value (and of G = Σ g) from the table's formula."""
    parts, grad = plan.row.formula(Entries(a, b, _ops(kept)), plan.weight, True, n_sums(plan) == 2)
    value = sum_parts(parts)
    return torch.stack([value] if grad is None else [value, grad.sum(dim=1)], dim=1)


def grad_constant(plan: ResolvedDivergence, sums: torch.Tensor) -> torch.Tensor | None:
    """G per row from the gathered sums [T, n_sums] (None: G = 0)."""
    constant = plan.row.constant
    return None if constant == "zero" else sums[:, 0] if constant == "value" else sums[:, 1]


# ----------------------------------------------------------------------------- backward


def student_grad(plan: ResolvedDivergence, a: torch.Tensor, b: torch.Tensor, constant: torch.Tensor | None,
                 kept: torch.Tensor | None) -> torch.Tensor:
    """dD/dz_s = g − p·G of the tile [r, c] (G per row [r], None: 0)."""
    e = Entries(a, b, _ops(kept))
    grad = plan.grad_terms(e)
    if constant is None:
        return grad
    return grad.addcmul_(e.p, constant[:, None], value=-1.0)
