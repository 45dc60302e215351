"""Shared pieces of the ops' property tests: hostile argument strategies, snapshots proving a
refused call changed nothing (values, requires_grad, .grad), and float64 comparisons."""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
DTYPES = FLOATS + [torch.int64, torch.float8_e4m3fn]
SPECIALS = [0.0, math.nan, math.inf, -math.inf]
# Scalar temperatures every op must refuse by name (bool and str: TypeError; the rest ValueError).
BAD_SCALARS = [0.0, -1.0, math.nan, math.inf, -math.inf, 1e-39, True, "1", 10**400, -(10**400), Fraction(10**400)]
CHUNKS = [None, 1, 3] * 3 + [0, -2, True, 2.5]  # legal ones mostly: a refusal ends the example


def generator(draw) -> torch.Generator:
    """Random tensors from a drawn seed: a replayed example gets the same values."""
    return torch.Generator().manual_seed(draw(st.integers(0, 2**16)))


def layout(draw, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` [R, C] cast to `dtype` as a contiguous, transposed-storage or column-strided tensor."""
    kind = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if kind == "transposed":
        return values.t().contiguous().to(dtype).t()
    if kind == "strided":
        x = torch.zeros(values.shape[0], 2 * values.shape[1], dtype=torch.float64).to(dtype)[:, ::2]
        x.copy_(values.to(dtype))
        return x
    return values.to(dtype)


def temperature(draw, T: int) -> Any:
    """A legal temperature (float, int, 0-d or per-token tensor) or a hostile one (bad scalars,
    tensors of a wrong shape / dtype / device, requiring grad, or holding bad values)."""
    kind = draw(st.sampled_from(["one", "float", "int", "tensor0", "per_token"] * 2 + ["bad", "bad_tensor"]))
    if kind == "one":
        return 1.0
    if kind == "float":
        return draw(st.sampled_from([0.3, 0.7, 1.9]))
    if kind == "int":
        return draw(st.sampled_from([1, 2, 10**6]))
    if kind == "tensor0":
        return torch.tensor(draw(st.sampled_from([0.5, 1.3])))
    if kind == "per_token":
        return torch.rand(T, dtype=torch.float64, generator=generator(draw)).add(0.4).float()
    if kind == "bad":
        return draw(st.sampled_from(BAD_SCALARS))
    bad = draw(st.sampled_from(["grad", "shape", "int", "meta", "values"]))
    if bad == "grad":
        return torch.ones(T).requires_grad_()
    if bad == "shape":
        return torch.ones(T + 1, 1)
    if bad == "int":
        return torch.ones(T, dtype=torch.int64)
    if bad == "meta":
        return torch.ones(T, device="meta")
    value = draw(st.sampled_from([0.0, -1.0, math.nan, math.inf, 1e-39]))
    if not T:
        return torch.tensor(value)
    t = torch.ones(T)
    t[draw(st.integers(0, T - 1))] = value
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), for every dtype."""
    a = torch.empty(a.numel(), dtype=a.dtype).copy_(a.detach().reshape(-1))  # dense, stride 1
    b = torch.empty(b.numel(), dtype=b.dtype).copy_(b.detach().reshape(-1))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def snapshot(*values: Any) -> list:
    """(tensor, clone, requires_grad, grad clone) of every CPU tensor among `values`."""
    return [
        (t, t.detach().clone(), t.requires_grad, None if t.grad is None else t.grad.clone())
        for t in values
        if isinstance(t, torch.Tensor) and t.device.type != "meta"
    ]


def unchanged(before: list, grads: bool = True) -> None:
    """The snapshot's tensors hold the same bits, requires_grad and (with `grads`) .grad."""
    for t, values, requires_grad, grad in before:
        assert same_bits(t, values) and t.requires_grad == requires_grad
        if grads:
            assert (t.grad is None) == (grad is None) and (grad is None or same_bits(t.grad, grad))


def close(got: torch.Tensor, want: torch.Tensor, magnitude: float, dtype: torch.dtype) -> bool:
    """fp32 math (fp64 for fp64 inputs) on the same rounded inputs: within 1e-5·max(1, |ref|) or a
    few ulps of the scaled logits' magnitude; bf16/fp16 products: 2e-2·max(1, |ref|)."""
    want = want.double()
    got = got.detach().double()
    if dtype in (torch.bfloat16, torch.float16):
        # bf16/fp16 matmul tiles (the fused head) round each logit to 2**-8 of its size, as the
        # unfused low-precision logits do: large logits get that rounding on top
        tol = torch.maximum(2e-2 * want.abs().clamp_min(1.0), torch.tensor(2.0**-7 * magnitude))
    else:
        eps = 1e-13 if dtype == torch.float64 else 2e-6
        tol = torch.maximum(1e-5 * want.abs().clamp_min(1.0) * (dtype != torch.float64),
                            torch.tensor(eps * (1.0 + magnitude)))
    both_inf = torch.isinf(want) & (got == want)
    return bool((both_inf | ((got - want).abs() <= tol)).all())


def tau64(tau: Any) -> Any:
    """The temperature the reference divides by: a [T, 1] float64 column or a float."""
    return tau.double().reshape(-1, 1) if isinstance(tau, torch.Tensor) else float(tau)


def min_tau(tau: Any) -> float:
    if isinstance(tau, torch.Tensor):
        return float(tau.min()) if tau.numel() else 1.0
    return float(tau)


@st.composite
def logits_case(draw, max_rows: int = 6, max_vocab: int = 12):
    """[T, V] logits of a drawn dtype, layout and device (cpu, sometimes meta), possibly holding
    0 / NaN / ±inf entries."""
    T = draw(st.integers(0, max_rows))
    V = draw(st.integers(1, max_vocab))
    scale = draw(st.sampled_from([0.1, 3.0, 40.0]))
    values = torch.randn(T, V, generator=generator(draw), dtype=torch.float64) * scale
    if T and draw(st.booleans()):  # sprinkle special values
        for _ in range(draw(st.integers(1, 3))):
            values[draw(st.integers(0, T - 1)), draw(st.integers(0, V - 1))] = draw(st.sampled_from(SPECIALS))
    x = layout(draw, values, draw(st.sampled_from(DTYPES)))
    device = draw(st.sampled_from(["cpu"] * 5 + ["meta"]))
    return x.to(device) if device == "meta" else x
