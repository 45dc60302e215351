"""Inputs, runs and tolerances shared by the full-vocabulary divergence tests (TP = 1 and TP = 2)."""
from __future__ import annotations

import math

import torch

from megatron_rl_patches import lm_head_divergence
from megatron_rl_patches.ops._divergences import DIVERGENCES
from megatron_rl_patches.testing.divergence_reference import dense_divergence

T, H, H_T, V_PADDED, VOCAB = 12, 8, 10, 72, 70  # two padding ids at the end (vocab_size=70)
CHUNK_ROWS = 4
TILE_BYTES = 4 * CHUNK_ROWS * 16  # 16 vocabulary columns per tile: the online rescaling runs
BETA, ALPHA = 0.3, 0.2
MIX3 = [0.5, 0.3, 0.2]
__all__ = ["DIVERGENCES"]


def make_inputs(n_teachers: int, dtype=torch.float64, seed=0, keep: bool = False, per_token_tau: bool = False):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    hidden, weight = randn(T, H, scale=1.5), randn(V_PADDED, H)
    teachers = [(randn(T, H_T, scale=1.5), randn(V_PADDED, H_T)) for _ in range(n_teachers)]
    keep_mask = torch.rand(T, V_PADDED, generator=g) > 0.35 if keep else None
    tau = (torch.rand(T, generator=g, dtype=torch.float64) + 0.5).to(dtype) if per_token_tau else 0.8
    grad_out = torch.randn(T, generator=g, dtype=torch.float64)
    return hidden, weight, teachers, keep_mask, tau, grad_out


def mixture(n_teachers: int):
    return {1: None, 2: [0.6, 0.4], 3: MIX3}[n_teachers]


def reference(divergence, hidden, weight, teachers, keep_mask, tau, grad_out):
    """(value, grad_hidden, grad_weight, lse) of the dense float64 route over the real vocabulary."""
    h = hidden.double().clone().requires_grad_()
    w = weight.double().clone().requires_grad_()
    keep = keep_mask[:, :VOCAB] if keep_mask is not None else None
    tau64 = tau.double() if isinstance(tau, torch.Tensor) else tau
    value = dense_divergence((h @ w.T)[:, :VOCAB], [(th.double() @ tw.double().T)[:, :VOCAB] for th, tw in teachers],
                             divergence=divergence, beta=BETA, alpha=ALPHA, teacher_weights=mixture(len(teachers)),
                             temperature=tau64, keep_mask=keep)
    gh, gw = torch.autograd.grad((value * grad_out).sum(), (h, w))
    with torch.no_grad():
        z = (h @ w.T)[:, :VOCAB] / (tau64[:, None] if isinstance(tau64, torch.Tensor) else tau64)
        lse = torch.logsumexp(z, dim=1)
    return value.detach(), gh, gw, lse


def ours(divergence, hidden, weight, teachers, keep_mask, tau, grad_out, **options):
    """(value, grad_hidden, grad_weight) of lm_head_divergence (one teacher passed as tensors)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if len(teachers) == 1:
        th, tw = teachers[0]
    else:
        th, tw = [t[0] for t in teachers], [t[1] for t in teachers]
    value = lm_head_divergence(h, w, th, tw, divergence=divergence, beta=BETA, alpha=ALPHA,
                               teacher_weights=mixture(len(teachers)), temperature=tau, vocab_size=VOCAB,
                               keep_mask=keep_mask, chunk_size=CHUNK_ROWS, **options)
    (value * grad_out.to(value.dtype)).sum().backward()
    return value.detach(), h.grad, w.grad


def float64_errors(got, want) -> tuple[float, float, float]:
    """(max |Δvalue|/(1 + |lse|), max |Δgrad_h| / max|grad_h|, same for grad_w)."""
    value, gh, gw = got
    ref, rgh, rgw, lse = want
    return (float(((value - ref).abs() / (1 + lse.abs())).max()),
            float((gh - rgh).abs().max() / max(float(rgh.abs().max()), 1e-300)),
            float((gw - rgw).abs().max() / max(float(rgw.abs().max()), 1e-300)))


def assert_float64(got, want, what) -> None:
    dv, dh, dw = float64_errors(got, want)
    assert dv <= 1e-9 and dh <= 1e-9 and dw <= 1e-9, (what, dv, dh, dw)


def assert_float32(got, want, what) -> None:
    value, gh, gw = (t.double() for t in got)
    ref, rgh, rgw, _ = want
    assert bool(((value - ref).abs() <= 1e-5 * ref.abs().clamp_min(1.0)).all()), (
        what, float((value - ref).abs().max()))
    for g, r, name in ((gh, rgh, "grad_hidden"), (gw, rgw, "grad_weight")):
        assert float((g - r).abs().max()) <= 1e-4 * float(r.abs().max()), (what, name, float((g - r).abs().max()))


def is_nontrivial(ref) -> bool:
    return math.isfinite(float(ref.sum())) and float(ref.abs().max()) > 1e-3
