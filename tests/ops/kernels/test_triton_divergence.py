"""lm_head_divergence with backend="triton" (the kernels fold every model's normalizer, the
table's formula runs on the recomputed tiles) against the torch tiles and the float64 dense
reference: values and both gradients. CUDA when present, else Triton's interpreter; small shapes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import triton_kit as kit  # noqa: E402

from megatron_rl_patches import lm_head_divergence  # noqa: E402
from megatron_rl_patches.testing.divergence_reference import dense_divergence  # noqa: E402

pytestmark = pytest.mark.triton
kit.require_kernels()

T, H, V = 20, 32, 48


def _models(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(T, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)
             * H**-0.5 * 2) for _ in range(n + 1)]


def _run(models, backend: str, **options):
    (h, w), teachers = models[0], models[1:]
    h, w = (t.float().to(kit.DEVICE).requires_grad_(True) for t in (h, w))
    loss = lm_head_divergence(h, w, [t[0].float().to(kit.DEVICE) for t in teachers],
                              [t[1].float().to(kit.DEVICE) for t in teachers], backend=backend, **options)
    loss.backward(torch.linspace(0.5, 1.5, T, device=kit.DEVICE))
    return [t.detach().double().cpu() for t in (loss, h.grad, w.grad)]


def _reference(models, **options):
    (h, w), teachers = models[0], models[1:]
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = dense_divergence(h @ w.T, [th @ tw.T for th, tw in teachers], **options)
    loss.backward(torch.linspace(0.5, 1.5, T, dtype=torch.float64))
    return [t.detach() for t in (loss, h.grad, w.grad)]


@pytest.mark.parametrize("divergence,n", [("jsd", 1), ("skew_reverse_kl", 2)])
def test_triton_normalizers_match_torch_and_float64(divergence, n, monkeypatch):
    from megatron_rl_patches.ops import divergence as op

    served = []
    fold = op._backend_stats
    monkeypatch.setattr(op, "_backend_stats", lambda *a: served.append(a[-1].name) or fold(*a))
    models = _models(n, seed=n)
    tau = torch.rand(T, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    options = dict(divergence=divergence, beta=0.3, temperature=tau)
    want = _reference(models, **options)
    options["temperature"] = tau.float().to(kit.DEVICE)
    got = _run(models, "triton", **options)
    assert served == ["triton"]  # the kernels folded the normalizers
    torch_tiles = _run(models, "torch", **options)
    for g, t, r, name in zip(got, torch_tiles, want, ("value", "grad_hidden", "grad_weight")):
        scale = max(1.0, r.abs().max().item())
        assert (g - r).abs().max().item() <= 2e-5 * scale, name
        assert (g - t).abs().max().item() <= 2e-5 * scale, name


def test_triton_backend_is_refused_by_name_where_it_cannot_run():
    models = _models(1)
    (h, w), (th, tw) = models
    with pytest.raises(ValueError, match="backend="):
        lm_head_divergence(h.float(), w.float(), th.float(), tw.float(), backend="nonesuch")
