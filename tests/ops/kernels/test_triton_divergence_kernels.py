"""lm_head_divergence's pass 2 and backward as Triton kernels (one teacher): every row of the
divergence table, against the torch tiles (the same table in torch ops) and the float64 dense
reference: values and both gradients, with a per-row temperature, a keep_mask, a row selection,
bf16 inputs and vocabulary padding. A spy proves the kernels served each call, so no test passes
on the torch fallback. CUDA when present, else Triton's interpreter; small shapes."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import triton_kit as kit  # noqa: E402

from megatron_rl_patches import lm_head_divergence  # noqa: E402
from megatron_rl_patches.ops._divergences import DIVERGENCES  # noqa: E402
from megatron_rl_patches.testing.divergence_reference import dense_divergence  # noqa: E402

pytestmark = pytest.mark.triton
kit.require_kernels()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from megatron_rl_patches.ops.kernels.triton import backend as triton_backend  # noqa: E402
from megatron_rl_patches.ops.kernels.triton._divergence import log_mix  # noqa: E402

T, H, H_T, V = 21, 24, 40, 50  # T, V not multiples of the interpreter's 16-wide blocks


@pytest.fixture
def served(monkeypatch):
    """Which of the kernel steps ran: 'sums' (pass 2) and 'grad' (backward)."""
    calls: list[str] = []
    sums, grad = triton_backend.TritonTiles.divergence_sums, triton_backend.TritonTiles.divergence_grad
    monkeypatch.setattr(triton_backend.TritonTiles, "divergence_sums",
                        lambda self, *a, **k: calls.append("sums") or sums(self, *a, **k))
    monkeypatch.setattr(triton_backend.TritonTiles, "divergence_grad",
                        lambda self, *a, **k: calls.append("grad") or grad(self, *a, **k))
    return calls


def _models(n_teachers: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32):
    """float64 values exact in `dtype`: [(h, w)] student first (teacher hidden size H_T)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(n_teachers + 1):
        hh = H if j == 0 else H_T
        h = torch.randn(T, hh, generator=g, dtype=torch.float64)
        w = torch.randn(V, hh, generator=g, dtype=torch.float64) * hh**-0.5 * 2.5
        out.append((h.to(dtype).double(), w.to(dtype).double()))
    return out


def _upstream() -> torch.Tensor:
    return torch.linspace(0.5, 1.5, T, dtype=torch.float64)


def _run(models, backend: str, dtype: torch.dtype, options: dict):
    (h, w), teachers = models[0], models[1:]
    h, w = (t.to(dtype).to(kit.DEVICE).requires_grad_(True) for t in (h, w))
    ths = [t[0].to(dtype).to(kit.DEVICE) for t in teachers]
    tws = [t[1].to(dtype).to(kit.DEVICE) for t in teachers]
    opts = {k: (v.to(kit.DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in options.items()}
    if isinstance(opts.get("temperature"), torch.Tensor):
        opts["temperature"] = opts["temperature"].float()
    loss = lm_head_divergence(h, w, ths[0] if len(ths) == 1 else ths, tws[0] if len(tws) == 1 else tws,
                              backend=backend, **opts)
    loss.backward(_upstream().to(loss.dtype).to(kit.DEVICE))
    return [t.detach().double().cpu() for t in (loss, h.grad, w.grad)]


def _reference(models, options: dict, n_valid: int = V):
    (h, w), teachers = models[0], models[1:]
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    opts = {k: v for k, v in options.items() if k not in ("vocab_size", "row_mask")}
    keep = opts.pop("keep_mask", None)
    loss = dense_divergence((h @ w.T)[:, :n_valid], [(th @ tw.T)[:, :n_valid] for th, tw in teachers],
                            keep_mask=None if keep is None else keep[:, :n_valid], **opts)
    rows = options.get("row_mask")
    if rows is not None:
        loss = torch.where(rows, loss, 0.0)
    loss.backward(_upstream())
    return [t.detach() for t in (loss, h.grad, w.grad)]


def _assert_within(got, want, tol: float, what: str) -> None:
    for g, r, name in zip(got, want, ("value", "grad_hidden", "grad_weight")):
        scale = max(1.0, r.abs().max().item())
        err = (g - r).abs().max().item()
        assert err <= tol * scale, f"{what} {name}: {err:.3g} > {tol:g}·{scale:.3g}"


def _tau() -> torch.Tensor:
    return torch.rand(T, generator=torch.Generator().manual_seed(7), dtype=torch.float64) + 0.5


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_every_table_row_matches_torch_tiles_and_float64(divergence, served):
    models = _models(seed=DIVERGENCES.index(divergence))
    options = dict(divergence=divergence, beta=0.3, alpha=0.2, temperature=_tau())
    want = _reference(models, options)
    got = _run(models, "triton", torch.float32, options)
    one_pass = divergence in ("forward_kl", "reverse_kl", "mixed_kl")  # their value is folded in pass 1
    assert served == (["grad"] if one_pass else ["sums", "grad"])
    tiles = _run(models, "torch", torch.float32, options)
    _assert_within(got, want, 2e-5, divergence)
    _assert_within(got, tiles, 2e-5, f"{divergence} (vs torch tiles)")


@pytest.mark.parametrize("divergence", ["jsd", "tv", "skew_forward_kl", "reverse_kl"])
def test_keep_mask_vocab_padding_and_row_selection(divergence, served):
    """Ids outside keep_mask have no term and no gradient; padded columns none either; rows
    left out of row_mask are 0 with no gradient."""
    models = _models(seed=3)
    g = torch.Generator().manual_seed(11)
    keep = torch.rand(T, V, generator=g) < 0.6
    keep[:, 0] = True
    rows = torch.rand(T, generator=g) < 0.7
    n_valid = V - 5
    options = dict(divergence=divergence, beta=0.6, alpha=0.3, keep_mask=keep, row_mask=rows, vocab_size=n_valid)
    want = _reference(models, options, n_valid)
    got = _run(models, "triton", torch.float32, options)
    assert "grad" in served
    _assert_within(got, want, 2e-5, divergence)
    assert got[0][~rows].abs().max() == 0 and got[1][~rows].abs().max() == 0
    assert got[2][n_valid:].abs().max() == 0  # the padding rows of dW


@pytest.mark.parametrize("divergence", ["jsd", "skew_reverse_kl", "tv"])
def test_bf16_inputs(divergence, served):
    """Two-pass divergences, whose value the kernels sum from exact products (the one-pass KLs'
    value folds on torch tiles, whose bf16 matmul rounds each logit to bf16)."""
    models = _models(seed=5, dtype=torch.bfloat16)
    options = dict(divergence=divergence, beta=0.4)
    want = _reference(models, options)
    got = _run(models, "triton", torch.bfloat16, options)
    assert "grad" in served
    tiles = _run(models, "torch", torch.bfloat16, options)
    _assert_within(got[:1], want[:1], 3e-5, divergence)  # fp32 math on exact bf16 products
    # the gradients' matmuls take dz in bf16 on both routes: no further from float64 than the torch tiles
    for g, t, r, name in zip(got[1:], tiles[1:], want[1:], ("grad_hidden", "grad_weight")):
        assert (g - r).abs().max() <= 1.5 * (t - r).abs().max() + 1e-6, name


def test_two_teachers_and_fp64_stay_on_the_torch_tiles(served):
    """The mixture of several teachers and fp64 are not the kernels' (serves_divergence says so)."""
    models = _models(n_teachers=2, seed=9)
    options = dict(divergence="jsd", teacher_weights=[0.3, 0.7])
    want = _reference(models, options)
    _assert_within(_run(models, "triton", torch.float32, options), want, 2e-5, "two teachers")
    _assert_within(_run(_models(seed=9), "triton", torch.float64, dict(divergence="jsd")),
           _reference(_models(seed=9), dict(divergence="jsd")), 1e-10, "fp64")
    assert served == []


def test_extreme_logits_give_finite_exact_terms(served):
    """Logits scaled ×40: most probabilities underflow to 0 in fp32; the terms stay finite and
    match float64 (0·log 0 = 0, the mixtures' log1p kept accurate)."""
    models = [(h * 40, w) for h, w in _models(seed=13)]
    for divergence in ("jsd", "skew_reverse_kl", "skew_forward_kl", "tv"):
        options = dict(divergence=divergence, beta=0.5, alpha=0.1)
        got = _run(models, "triton", torch.float32, options)
        assert all(torch.isfinite(t).all() for t in got), divergence
        _assert_within(got, _reference(models, options), 5e-5, divergence)


def test_log_mix_keeps_small_second_terms():
    """log(w·e^x + (1 − w)·e^y) near 0 (w close to 1, x near 0) with the second term 1e-6 to 1e-4
    of the first: log(1 + y) in fp32 would lose y to 1's rounding (relative errors up to 1e-3
    of the answer)."""
    w = 1.0 - 1e-4
    x = -torch.linspace(1e-6, 2e-6, 16, dtype=torch.float32)
    y = torch.linspace(-4.0, -1.0, 16, dtype=torch.float32)
    out = torch.empty(16, device=kit.DEVICE)
    mix_kernel[(1,)](x.to(kit.DEVICE), y.to(kit.DEVICE), out, math.log(w), math.log1p(-w), N=16)
    ref = torch.logaddexp(x.double() + math.log(w), y.double() + math.log1p(-w))
    rel = ((out.double().cpu() - ref).abs() / ref.abs()).max().item()
    assert rel < 1e-5, rel


@triton.jit
def mix_kernel(x_ptr, y_ptr, out_ptr, log_w, log_1mw, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, log_mix(tl.load(x_ptr + i), tl.load(y_ptr + i), log_w, log_1mw))
