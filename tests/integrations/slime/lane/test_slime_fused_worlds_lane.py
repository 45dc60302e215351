"""slime_fused against slime's own logits path at the layouts of real jobs (issue 40): slime
624b824a's real forward_only and train_one_step on 1-8 gloo ranks (each a fresh interpreter), the
same fresh weights unpatched and with slime_fused; per rank, log-probs, entropy, losses and the
reduced gradients agree to fp32 rounding (bf16: to bf16 rounding). Layouts: TP=2 without and with
sequence parallelism (the kit's SP norm shim), CP=2 zigzag, CP=2 `--allgather-cp` (the lane declares
a DSA architecture to slime's own check, slime_ranks.DSA_CONFIG), PP=2, PP=2 with 2 virtual stages,
TP=2 x PP=2 x CP=2 zigzag on 8 ranks, DP=2 with the distributed
optimizer, bf16 (Float16Module) and full activation recompute. The negative control: the same
comparison sees a changed weight (test_comparison_sees_a_perturbed_gradient)."""
from __future__ import annotations

import sys

import pytest
import torch

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.layouts import BY_MARKER

pytestmark = pytest.mark.slime

RECOMPUTE = BY_MARKER["recompute"].megatron_lm_args
EP2 = BY_MARKER["ep2"].megatron_lm_args
# name: (ranks, pipeline, context, tensor, virtual chunks, slime's extra flags, layout markers); "ep2":
# an MoE student, slime's alltoall dispatcher set back to allgather (slime_ranks.MOE_VALUES);
# "pp2vpp2": 2 model chunks of one layer per stage (Megatron-LM's arguments turn batch_p2p_comm off)
WORLDS = {
    "ep2": (2, 1, 1, 1, None, EP2, ("ep2", "thd")),
    "tp2": (2, 1, 1, 2, None, (), ("tp2", "thd")),
    "tp2sp": (2, 1, 1, 2, None, BY_MARKER["sp"].megatron_lm_args, ("tp2", "sp", "thd")),
    "cp2": (2, 1, 2, 1, None, (), ("cp2-zigzag", "thd")),
    "cp2ag": (2, 1, 2, 1, None, BY_MARKER["cp2-allgather"].megatron_lm_args, ("cp2-allgather", "thd")),
    "pp2": (2, 2, 1, 1, None, (), ("pp2", "thd")),
    "pp2vpp2": (2, 2, 1, 1, 2, (), ("vpp2", "pp2", "thd")),
    "tp2pp2cp2": (8, 2, 2, 2, None, (), ("tp2", "pp2", "cp2-zigzag", "thd")),
    "dp2distopt": (2, 1, 1, 1, None, (), ("distopt", "thd")),  # ARGV: --use-distributed-optimizer
    "bf16": (1, 1, 1, 1, None, BY_MARKER["bf16"].megatron_lm_args, ("bf16", "thd")),
    "recompute": (1, 1, 1, 1, None, RECOMPUTE, ("recompute", "thd")),
}


@pytest.fixture(scope="module", params=[pytest.param(n, marks=layouts.mark(*WORLDS[n][-1])) for n in WORLDS])
def world(request):
    if "slime_standins" not in sys.modules:  # the lane's conftest installs them where slime's source is found
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    import slime_ranks  # the lane folder is on sys.path (conftest)

    from megatron_rl_patches.testing.multirank import run_multirank

    ranks, pipeline, context, tensor, virtual, flags, _ = WORLDS[request.param]
    expert = 2 if flags == EP2 else 1
    return request.param, run_multirank(slime_ranks.fused_and_plain, ranks, pipeline, context, tensor, flags,
                                        expert, virtual, timeout=900 if ranks > 2 else 300)


def _tolerance(name: str) -> dict:
    return dict(rtol=2e-2, atol=2e-2) if name == "bf16" else dict(rtol=1e-4, atol=2e-5)


def _differences(plain: dict, fused: dict, name: str) -> dict[str, float]:
    """The largest difference per quantity between the routes on one rank (asserting each)."""
    tolerance, largest = _tolerance(name), {}
    for key in ("log_probs", "entropy"):
        if plain[key] is None:  # a stage before the last: no log-probs
            assert fused[key] is None
            continue
        for a, b in zip(plain[key], fused[key], strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, **tolerance)
            largest[key] = max(largest.get(key, 0.0), (b - a).abs().max().item() if a.numel() else 0.0)
    assert set(fused["losses"]) == set(plain["losses"])
    for key, value in plain["losses"].items():
        assert abs(fused["losses"][key] - value) <= tolerance["atol"] + tolerance["rtol"] * abs(value), key
        largest["losses"] = max(largest.get("losses", 0.0), abs(fused["losses"][key] - value))
    assert abs(fused["grad_norm"] - plain["grad_norm"]) <= 1e-4 * max(1.0, plain["grad_norm"])
    assert sorted(fused["grads"]) == sorted(plain["grads"]) and plain["grads"]
    for key, g in plain["grads"].items():
        torch.testing.assert_close(fused["grads"][key], g, **tolerance, msg=key)
        largest["grads"] = max(largest.get("grads", 0.0), (fused["grads"][key] - g).abs().max().item())
    return largest


def _layers(grads: dict) -> set[int]:
    """The global layer numbers (from 0) a rank's gradients cover."""
    return {int(key.split(".")[2]) for key in grads if key.startswith("decoder.layers.")}


def test_fused_equals_slimes_logits_path_on_every_rank(slime_cpu, world):
    name, ranks = world
    largest: dict[str, float] = {}
    for rank in ranks:
        for key, value in _differences(rank["plain"], rank["fused"], name).items():
            largest[key] = max(largest.get(key, 0.0), value)
    assert "log_probs" in largest and "grads" in largest
    if name == "bf16":  # the layout ran: Float16Module holds bf16 parameters
        assert torch.bfloat16 in set(ranks[0]["plain"]["params"].values())
    if name == "ep2":  # the layout ran: each rank holds 2 of the 4 experts, dispatched by allgather
        assert ranks[0]["plain"]["dispatcher"] == "allgather"
        assert any("local_experts.1." in key for key in ranks[0]["plain"]["grads"])
        assert not any("local_experts.2." in key for key in ranks[0]["plain"]["grads"])
    if name == "pp2vpp2":  # the layout ran: the first stage holds model chunks 0 and 2 of 4 one-layer chunks
        assert _layers(ranks[0]["plain"]["grads"]) == {0, 2} and _layers(ranks[1]["plain"]["grads"]) == {1, 3}
    if name == "tp2pp2cp2":  # the layout ran: 8 ranks, log-probs on the last stage's 4 only
        assert len(ranks) == 8 and sum(rank["plain"]["log_probs"] is not None for rank in ranks) == 4
    said = ", ".join(f"max |Δ{key}| {value:.2e}" for key, value in largest.items())
    print(f"slime_fused vs slime's logits path [{name}]: {said}")


def test_comparison_sees_a_perturbed_gradient(slime_cpu, world):
    """The negative control: one gradient element moved by 1e-3 fails the comparison."""
    name, ranks = world
    plain, fused = ranks[0]["plain"], dict(ranks[0]["fused"])
    key = sorted(fused["grads"])[0]
    fused["grads"] = {**fused["grads"], key: fused["grads"][key].clone()}
    fused["grads"][key].view(-1)[0] += 1e-3 if name != "bf16" else 1.0
    with pytest.raises(AssertionError):
        _differences(plain, fused, name)
