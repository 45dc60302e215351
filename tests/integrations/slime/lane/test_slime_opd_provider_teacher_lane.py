"""slime_opd with a separate-architecture teacher at PP=2 (issue 40): `PATH@module:function`
(slime_ranks.wide_teacher: the packed tiny GPT wider and deeper than the actor, the same
vocabulary) built inference-only by `build_inference_model` on the actor's pipeline split and
loaded from a torch_dist checkpoint saved at one rank (resharded on load), beside a snapshot teacher, through slime
624b824a's real `train_actor` on 2 gloo ranks. Both stages run the wide teacher's pipelined pass;
the first step's OPD loss and every gradient against dense float64 (the wide teacher rebuilt
whole in float64 from the stages' weights). The negative control: the same reference with the
wide teacher's weights changed misses the loss."""
from __future__ import annotations

import sys
import tempfile

import pytest
import torch

from megatron_rl_patches.testing import layouts

pytestmark = [pytest.mark.slime, layouts.mark("pp2", "thd")]

WEIGHTS = (0.3, 0.7)


@pytest.fixture(scope="module")
def stages():
    if "slime_standins" not in sys.modules:  # the lane's conftest installs them where slime's source is found
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    import slime_kit as kit
    import slime_ranks  # the lane folder is on sys.path (conftest)
    import slime_standins

    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.multirank import run_multirank

    with tempfile.TemporaryDirectory() as tmp:
        slime_standins.cpu_accelerator()
        with megatron_on_cpu(), kit.slime_session() as args:  # saved at one rank, loaded at PP=2 (resharded)
            slime_ranks.save_wide_teacher(args, f"{tmp}/wide")
        yield run_multirank(slime_ranks.opd_train_actor, 2, 2, 1, 1, None, None, (), 1, f"{tmp}/wide",
                            timeout=300)


def _whole(stages: list[dict], tag: str) -> dict[str, torch.Tensor]:
    whole: dict[str, torch.Tensor] = {}
    for stage in stages:
        assert not set(whole) & set(stage["states"][tag])
        whole.update(stage["states"][tag])
    return whole


def _reference(stages: list[dict], wide_noise: float = 0.0):
    import slime_kit as kit
    import slime_ranks

    states = {tag: _whole(stages, tag) for tag in ("actor", "opd_teacher_0", "opd_teacher_1")}
    grads = _whole([{"states": {"g": s["grads"]}} for s in stages], "g")
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS) as args:
        full = kit.provider_func(args)()
        names = [name for name, _ in full.named_parameters()]
        with torch.no_grad():
            for name, p in full.named_parameters():
                p.copy_(states["actor"][name])
        wide = kit.provider_func(args)(config=slime_ranks.wide_config(args)).double()
        assert sorted(n for n, _ in wide.named_parameters()) == sorted(states["opd_teacher_1"])
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in wide.named_parameters():
                p.copy_(states["opd_teacher_1"][name] + wide_noise * torch.randn(p.shape, generator=gen))
        snapshots = [[states["opd_teacher_0"][name] for name in names], wide]
        ids = stages[-1]["ids"]
        expected, student = kit.dense_topk_opd(args, [full], snapshots, kit.rollout(0), ids, WEIGHTS,
                                               slime_ranks.TEMPERATURE)
    return expected, student, grads


def test_separate_teacher_on_the_actors_pipeline_split_equals_dense_float64(slime_cpu, stages):
    from megatron_rl_patches.integrations.slime import opd as slime_opd

    first, last = stages
    assert first["losses"] is None and first["keys"] == []  # the buckets live on the last stage
    assert last["keys"] == sorted([slime_opd.IDS, slime_opd.TEACHER_LOGPROBS, slime_opd.TEACHER_TAILS])
    # the wide teacher split as the actor is: stage 0 its first 2 of 4 layers, stage 1 the rest and the head
    assert {n.split(".")[2] for n in first["states"]["opd_teacher_1"] if n.startswith("decoder.layers.")} == {"0", "1"}
    assert "output_layer.weight" in last["states"]["opd_teacher_1"]
    expected, student, grads = _reference(stages)
    (losses,) = last["losses"]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd train_actor PP=2 with a separate wide teacher vs dense float64: loss {float(expected):.6f}, "
          f"|Δloss| {loss_error:.2e}, max |Δgrad| {grad_error:.2e}")
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_reference_sees_the_wide_teachers_weights(slime_cpu, stages):
    expected, _, _ = _reference(stages, wide_noise=0.1)
    (losses,) = stages[-1]["losses"]
    assert abs(float(losses["opd_topk_loss"]) - float(expected)) > 1e-4
