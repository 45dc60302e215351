"""The largest temperature accepted is one every path computes (issue 80 item 9): "finite, > 0" took
τ = 1e50, and from about 7e45 the scale 1/τ underflows float32 to 0: the top-k log-probs and tails
came back NaN while the token log-probs stayed right. The bound: 1/τ a normal float32
(`largest_temperature`, ~8.5e37). At it every op is finite, and the log-probs and tails equal
float64's (the distribution is uniform to 1e-37 there), as a float and as a per-token tensor, in the
default and the invariant mode; the next float32 above is refused by name, as are 1e46 and 1e50;
float64 inputs compute up to 1/finfo(float64).tiny."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_patches import ops
from megatron_rl_patches.ops._checks import largest_temperature
from tests.ops.checks.test_temperature_boundary import T, V, _inputs, calls, forms


def above(tau: float) -> float:
    """The float32 just above `tau` (a tensor temperature is float32)."""
    return float(torch.nextafter(torch.tensor(tau, dtype=torch.float32), torch.tensor(math.inf)))


def test_the_largest_temperature_is_a_float32_whose_scale_is_normal():
    tau = largest_temperature(torch.float32)
    assert float(torch.tensor(tau, dtype=torch.float32)) == tau  # a tensor holds it exactly
    scale = torch.tensor(1.0) / torch.tensor(tau)
    assert scale >= torch.finfo(torch.float32).tiny and scale * (1 / math.log(2)) >= torch.finfo(torch.float32).tiny
    assert 8e37 < tau < 2.0**126 and largest_temperature(torch.bfloat16) == tau
    assert largest_temperature(torch.float64) == pytest.approx(1 / torch.finfo(torch.float64).tiny, rel=1e-5)


def reference(tau: float) -> dict:
    """float64's log-softmax of the logits / τ at the argmax and the top-2 ids, and the tail."""
    h, w, x, top, ids = _inputs()
    logp = torch.log_softmax(x.double() / tau, dim=1)
    at = logp.gather(1, ids)
    return {"token": logp.gather(1, top[:, None])[:, 0], "topk": at,
            "tail": torch.log1p(-at.exp().sum(1)), "entropy": -(logp.exp() * logp).sum(1)}


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("form", ["float", "tensor"])
@pytest.mark.parametrize("name", sorted(calls("torch")))
def test_every_op_at_the_largest_temperature_is_finite_and_float64s_and_above_is_refused(name, form, invariant):
    call = calls("torch")[name]
    tau = largest_temperature(torch.float32)
    out = call(forms(tau)[form], invariant)
    for t in out:
        if t is not None and t.is_floating_point():
            assert torch.isfinite(t).all(), (name, out)
    want = reference(tau)
    if name.endswith("topk_logprobs"):
        torch.testing.assert_close(out[0].double(), want["topk"], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[1].double(), want["tail"], atol=1e-5, rtol=0)
    if name.endswith("log_probs_and_entropy"):
        torch.testing.assert_close(out[0].double(), want["token"], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[1].double(), want["entropy"], atol=1e-4, rtol=0)
    assert want["token"].sub(-math.log(V)).abs().max() < 1e-12  # uniform there: the check is not vacuous
    for past in (above(tau), 1e46, 1e50):
        value = forms(past)[form] if past < 3e38 else (past if form == "float" else None)
        if value is None:  # a float32 tensor cannot hold it: an infinity, refused as not finite elsewhere
            continue
        with pytest.raises(ValueError, match=r"temperature must be <= 8\.50705e\+37"):
            call(value, invariant)


def test_float64_inputs_compute_up_to_their_own_bound():
    h, w, x, top, ids = _inputs()
    tau = largest_temperature(torch.float64)
    values, tail = ops.topk_logprobs(x.double(), ids, temperature=tau)
    assert torch.isfinite(values).all() and torch.isfinite(tail).all()
    torch.testing.assert_close(values, torch.full((T, 2), -math.log(V), dtype=torch.float64), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match=r"temperature must be <= 4\.49423e\+307"):
        ops.topk_logprobs(x.double(), ids, temperature=tau * (1 + 2**-40))
