"""The backend contract of the statistics core (ops/_stats.py): a backend written here, against
the contract alone — whole-row float64 tiles, its own tiling — registers by name and every
public vocabulary op runs on it with no change anywhere else, matching float64 references."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import (
    lm_head_log_probs_and_entropy,
    lm_head_topk_logprobs,
    log_probs_and_entropy,
    topk_logprobs,
    topk_opd_loss,
)
from megatron_rl_patches.ops import _stats, kernels
from megatron_rl_patches.testing.logprob_reference import reference_log_probs, scaled_logits


class Float64Rows:
    """Each tile: 3 rows of the whole vocabulary shard, materialized in float64."""

    name = "float64-test"

    def __init__(self) -> None:
        self.calls = {"row_stats": 0, "apply_grad": 0}

    def available(self, device):
        return None

    def claims(self, device):
        return False  # only when asked for by name

    def _tiles(self, source):
        for r0 in range(0, source.n_rows, 3):
            rows = slice(r0, min(source.n_rows, r0 + 3))
            if source.fused:
                x = source.hidden[rows].double() @ source.weight[: source.n_valid].double().t()
            else:
                x = source.logits[rows, : source.n_valid].double()
            yield rows, x

    def row_stats(self, source, stats, cols, owned, keep_mask, scale):
        self.calls["row_stats"] += 1
        for rows, x in self._tiles(source):
            subset = keep_mask[rows, : source.n_valid] if keep_mask is not None else None
            marks = _stats.column_marks(cols[rows], owned[rows], 0, x.size(1))
            part = _stats.RowStats.empty(x.size(0), cols.size(1), torch.float64, x.device, rest=stats.rest is not None,
                                         moment=stats.moment is not None, subset=stats.sub_shift is not None)
            _stats.fold_tile(part, slice(None), x, _stats.scale_rows(scale, rows), marks, subset)
            for name in ("shift", "marked", "rest", "moment", "sub_shift", "sub_sum"):
                if getattr(part, name) is not None:
                    getattr(stats, name)[rows] = getattr(part, name).to(stats.shift.dtype)
        return stats

    def apply_grad(self, source, factors, scale, keep_mask, needs):
        self.calls["apply_grad"] += 1
        dtype = factors.dtype
        if source.fused:
            grads = [torch.zeros(source.hidden.shape, dtype=torch.float64),
                     torch.zeros(source.weight.shape, dtype=torch.float64)]
        else:
            grads = [torch.zeros(source.logits.shape, dtype=torch.float64)]
        for rows, x in self._tiles(source):
            subset = keep_mask[rows, : source.n_valid] if keep_mask is not None else None
            f64 = factors.rows(rows)
            dz = _stats.tile_grad(x, 0, _stats.scale_rows(scale, rows), f64, subset).double()
            if source.fused:
                grads[0][rows] += dz @ source.weight[: source.n_valid].double()
                grads[1][: source.n_valid] += dz.t() @ source.hidden[rows].double()
            else:
                grads[0][rows, : source.n_valid] = dz
        return tuple(g.to(dtype) if need else None for g, need in zip(grads, needs))


@pytest.fixture
def float64_backend():
    backend = Float64Rows()
    kernels.register_backend(backend)
    yield backend
    kernels._REGISTRY.pop(backend.name)


def _inputs(seed=0, T=10, H=6, V=37):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g) * 2
    weight = torch.randn(V, H, generator=g)
    tokens = torch.randint(0, V, (T,), generator=g)
    keep = torch.rand(T, V, generator=g) < 0.5
    keep[torch.arange(T), tokens] = True
    return hidden, weight, tokens, keep, torch.rand(T, generator=g) + 0.5


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_log_probs_and_entropy_on_a_registered_backend_match_float64(float64_backend, masked, fused):
    hidden, weight, tokens, keep, tau = _inputs()
    a, b = torch.randn(tokens.shape), torch.randn(tokens.shape)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    kwargs = dict(with_entropy=True, temperature=tau, keep_mask=keep if masked else None, backend=float64_backend.name)
    if fused:
        lp, ent = lm_head_log_probs_and_entropy(h, w, tokens, **kwargs)
    else:
        logits = (h @ w.t())
        lp, ent = log_probs_and_entropy(logits, tokens, **kwargs)
    ((lp * a).sum() + (ent * b).sum()).backward()
    assert float64_backend.calls == {"row_stats": 1, "apply_grad": 1}

    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_lp, ref_ent = reference_log_probs(hd @ wd.t(), tokens, temperature=tau, keep_mask=keep if masked else None)
    ((ref_lp * a.double()).sum() + (ref_ent * b.double()).sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), hd.grad, rtol=0, atol=1e-4)
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=0, atol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_topk_ops_on_a_registered_backend_match_float64(float64_backend, fused):
    hidden, weight, _, _, tau = _inputs(1)
    ids = torch.stack([torch.randperm(weight.size(0))[:4] for _ in range(hidden.size(0))])
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if fused:
        lp, tail = lm_head_topk_logprobs(h, w, ids, temperature=tau, backend=float64_backend.name)
    else:
        lp, tail = topk_logprobs(h @ w.t(), ids, temperature=tau, backend=float64_backend.name)
    (lp.sum() * 0.3 + tail.sum()).backward()
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp_all = torch.log_softmax(scaled_logits(hd @ wd.t(), tau, None), -1)
    ref_lp = logp_all.gather(1, ids)
    ref_tail = torch.log1p(-ref_lp.exp().sum(-1))
    (ref_lp.sum() * 0.3 + ref_tail.sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(tail.double(), ref_tail, rtol=0, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), hd.grad, rtol=0, atol=1e-4)
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=0, atol=1e-4)
    # and through the loss built on the op
    loss = topk_opd_loss(h.detach() @ w.detach().t(), ids, ref_lp.detach().float(), temperature=tau,
                         backend=float64_backend.name)
    assert bool(torch.isfinite(loss).all()) and float(loss.abs().max()) < 1e-5


def test_unknown_or_unavailable_backends_are_named_errors(monkeypatch):
    hidden, weight, tokens, _, _ = _inputs()
    with pytest.raises(ValueError, match="backend='nope' is not a backend; choose one of auto, torch"):
        log_probs_and_entropy(hidden @ weight.t(), tokens, backend="nope")
    monkeypatch.setenv(kernels.BACKEND_ENV, "cuda-magic")
    with pytest.raises(ValueError, match="MEGATRON_RL_PATCHES_BACKEND='cuda-magic' is not a backend"):
        log_probs_and_entropy(hidden @ weight.t(), tokens)
    monkeypatch.setenv(kernels.BACKEND_ENV, "torch")
    lp, _ = log_probs_and_entropy(hidden @ weight.t(), tokens)
    assert lp.shape == tokens.shape


def test_a_backend_of_the_earlier_protocol_keeps_working_and_auto_sees_its_claim():
    plain = Float64Rows()  # no base class: available(device) / claims(device) only
    registered = kernels.register_backend(plain)
    try:
        assert isinstance(registered, kernels.Backend) and registered.topk is None  # the torch tiles' top-k
        assert kernels.resolve_backend(plain.name, torch.device("cpu"), torch.float32) is registered
        hidden, weight, tokens, _, _ = _inputs()
        log_probs_and_entropy(hidden @ weight.t(), tokens)  # auto: it does not claim the CPU
        assert plain.calls["row_stats"] == 0
    finally:
        kernels._REGISTRY.pop(plain.name)
    claiming = Float64Rows()
    claiming.claims = lambda device: device.type == "cpu"
    kernels.register_backend(claiming)
    try:
        lp, _ = log_probs_and_entropy(hidden @ weight.t(), tokens)  # auto picks it: its claim, for any dtype
        assert claiming.calls["row_stats"] == 1
        torch.testing.assert_close(lp, log_probs_and_entropy(hidden @ weight.t(), tokens, backend="torch")[0],
                                   rtol=0, atol=1e-5)
    finally:
        kernels._REGISTRY.pop(claiming.name)


class Float64Only(Float64Rows, kernels.Backend):
    """A backend of the base class that `auto` picks for float64 inputs only (it sees the dtype)."""

    name = "float64-only"

    def claims_for(self, device, dtype):
        return dtype == torch.float64


def test_auto_sees_the_dtype_and_defaults_fill_the_optional_members():
    backend = Float64Only()
    assert kernels.register_backend(backend) is backend
    try:
        hidden, weight, tokens, _, _ = _inputs()
        lp32, _ = log_probs_and_entropy(hidden @ weight.t(), tokens)
        assert backend.calls["row_stats"] == 0
        lp64, _ = log_probs_and_entropy((hidden @ weight.t()).double(), tokens)
        assert backend.calls["row_stats"] == 1 and lp64.dtype == torch.float64
        torch.testing.assert_close(lp64.float(), lp32, rtol=0, atol=1e-5)
        assert kernels.topk_step(backend) == kernels.resolve_backend("torch", torch.device("cpu")).topk
        assert not backend.serves_divergence(None, [], None)
    finally:
        kernels._REGISTRY.pop(backend.name)
