"""The smallest temperature accepted is one every path computes (issue 63 item 3): the checks took τ
down to 1/finfo(float32).max, but the default mode's exp2 steps scale by (1/τ)·log2 e, which overflows
float32 below τ ≈ 4.24e-39 — log-probs and entropy NaN on every row. At `smallest_temperature` every
op gives the τ → 0 limit (the top logit's distribution: log p 0 at the argmax, entropy 0) in the
default and the invariant mode, from a float and from a per-token tensor, on the torch tiles and the
Triton ones (interpreter on CPU; test_temperature_boundary_triton.py); the next float below is refused
by name."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_patches import ops
from megatron_rl_patches.ops._checks import smallest_temperature

T, V, H = 3, 5000, 4  # V past one CPU tile (2048 columns): the running sums move between tiles


def _inputs(device="cpu", vocab=V):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(T, H, generator=g)
    w = torch.randn(vocab, H, generator=g)
    x = h @ w.T
    top = x.argmax(dim=1)
    second = x.topk(2, dim=1).indices[:, 1]
    ids = torch.stack([top, second], dim=1)
    return [t.to(device) for t in (h, w, x, top, ids)]


def calls(backend: str, device: str = "cpu", vocab: int = V) -> dict:
    """Each op taking a temperature, as `call(tau, invariant) -> tensors`, with the argmax as token and
    the argmax and the second id as the top-k ids."""
    h, w, x, top, ids = _inputs(device, vocab)
    teacher = torch.full((T, 2), -1.0, device=device)
    opts = dict(backend=backend)
    return {
        "log_probs_and_entropy": lambda tau, inv: ops.log_probs_and_entropy(
            x, top, temperature=tau, with_entropy=True, invariant=inv, **opts),
        "topk_logprobs": lambda tau, inv: ops.topk_logprobs(x, ids, temperature=tau, invariant=inv, **opts),
        "topk_opd_loss": lambda tau, inv: (ops.topk_opd_loss(x, ids, teacher, temperature=tau, invariant=inv,
                                                             **opts),),
        "lm_head_log_probs_and_entropy": lambda tau, inv: ops.lm_head_log_probs_and_entropy(
            h, w, top, temperature=tau, with_entropy=True, invariant=inv, **opts),
        "lm_head_topk_logprobs": lambda tau, inv: ops.lm_head_topk_logprobs(
            h, w, ids, temperature=tau, invariant=inv, **opts),
        "lm_head_topk_ids": lambda tau, inv: (ops.lm_head_topk_ids(h, w, 2, temperature=tau, invariant=inv,
                                                                   **opts),),
    }


def below(tau: float) -> float:
    """The float32 just below `tau` (a tensor temperature is float32)."""
    return float(torch.nextafter(torch.tensor(tau, dtype=torch.float32), torch.tensor(0.0)))


def check_limit(name: str, out) -> None:
    """The τ → 0 limit: no NaN; log p 0 at the argmax, entropy 0; the second id's log p below -1e30."""
    for t in out:
        if t is not None:
            assert not torch.isnan(t).any(), (name, out)
    if name.endswith("log_probs_and_entropy"):
        assert torch.equal(out[0], torch.zeros(T, device=out[0].device)), (name, out)
        assert torch.equal(out[1], torch.zeros(T, device=out[1].device)), (name, out)
    if name.endswith("topk_logprobs"):
        assert torch.equal(out[0][:, 0], torch.zeros(T, device=out[0].device)), (name, out)
        assert (out[0][:, 1] < -1e30).all(), (name, out)  # (x2 - x1)/τ: -inf, or finite in the invariant mode


def forms(tau: float, device: str = "cpu") -> dict:
    return {"float": tau, "tensor": torch.full((T,), tau, dtype=torch.float32, device=device)}


def test_the_smallest_temperature_is_a_float32_whose_scale_in_powers_of_two_is_finite():
    tau = smallest_temperature(torch.float32)
    assert float(torch.tensor(tau, dtype=torch.float32)) == tau  # a tensor holds it exactly
    scale = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(tau, dtype=torch.float32)
    assert torch.isfinite(scale * (1 / math.log(2))) and 1 / tau * (1 / math.log(2)) < torch.finfo().max
    assert tau < 5e-39  # still 1/τ's range, give or take log2 e


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("form", ["float", "tensor"])
@pytest.mark.parametrize("name", sorted(calls("torch")))
def test_every_op_at_the_smallest_temperature_gives_the_limit_and_below_is_refused(name, form, invariant):
    call = calls("torch")[name]
    tau = smallest_temperature(torch.float32)
    check_limit(name, call(forms(tau)[form], invariant))
    with pytest.raises(ValueError, match=r"temperature must be >= "):
        call(forms(below(tau))[form], invariant)


def tp_checks(rank: int, world: int) -> dict:
    """At TP = world (the invariance worlds, tests/ops/invariance): each op at the smallest temperature
    over this rank's vocabulary shard, both modes — where the ranks' sums are moved to the global max
    ((old - new)·s overflowed: 0·(-inf) = NaN in the entropy's moment)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    h, w, x, top, ids = _inputs()
    shard = slice(rank * V // world, (rank + 1) * V // world)
    tau = smallest_temperature(torch.float32)
    opts = dict(tp_group=group, temperature=tau)
    out = {}
    for invariant in (False, True):
        out["log_probs_and_entropy", invariant] = ops.log_probs_and_entropy(
            x[:, shard], top, with_entropy=True, invariant=invariant, **opts)
        out["topk_logprobs", invariant] = ops.topk_logprobs(x[:, shard], ids, invariant=invariant, **opts)
        out["lm_head_log_probs_and_entropy", invariant] = ops.lm_head_log_probs_and_entropy(
            h, w[shard], top, with_entropy=True, invariant=invariant, **opts)
        out["lm_head_topk_logprobs", invariant] = ops.lm_head_topk_logprobs(h, w[shard], ids, invariant=invariant,
                                                                           **opts)
    return {case: [t.detach() for t in value] for case, value in out.items()}



def test_moving_sums_to_a_far_larger_max_at_the_smallest_temperature_gives_no_nan():
    """The step every merge takes (the Triton kernel's splits, the ranks' combine): sums at a shift 5
    below the new max, scale 1/τ: (old - new)·s overflowed to -inf and the moment 0·(-inf) = NaN."""
    from megatron_rl_patches.ops._stats import RowStats, moved_stats

    stats = RowStats(shift=torch.tensor([0.0]), marked=torch.zeros(1, 0), rest=torch.tensor([1.0]),
                     moment=torch.tensor([0.0]))
    out = moved_stats(stats, torch.tensor([5.0]), None, 1.0 / smallest_temperature(torch.float32))
    assert torch.equal(out.rest, torch.zeros(1)) and torch.equal(out.moment.abs(), torch.zeros(1)), out
