"""slime 624b824a's routing replay (`ENABLE_ROUTING_REPLAY=1`) on slime_fused, on an MoE student
(4 experts, top-2) with slime's router patch: routes recorded by slime's real forward_only, then
perturbed (each token's experts shifted by one), replayed by forward_only and by train_one_step
(slime sets `ROUTING_REPLAY_STAGE=replay_forward` around its model call). Unpatched vs fused:
log-probs, entropy, losses, gradient norm and weights after the step; the negative control: the
perturbed routes change the fused log-probs (on a dense model, or with replay ignored, they
could not)."""
from __future__ import annotations

import logging

import pytest
import torch

from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.slime

import megatron_rl_patches  # noqa: E402

FUSED = ["slime_fused", "gpt_output_processor"]
TEMPERATURE = 0.7
EXPERTS = 4


def _kits():
    import slime_kit
    import slime_routing

    return slime_kit, slime_routing


def _replayed(monkeypatch, fused: bool):
    """(log-probs of the router's own routes, log-probs / entropy replaying the perturbed routes,
    losses, gradient norm, weights after one train_one_step replaying them)."""
    from slime.backends.megatron_utils import model as slime_model
    from slime.utils.routing_replay import RoutingReplay

    kit, routing = _kits()
    monkeypatch.setattr(RoutingReplay, "all_routing_replays", [])
    monkeypatch.setenv("ENABLE_ROUTING_REPLAY", "1")
    monkeypatch.setenv("ROUTING_REPLAY_STAGE", "record")
    if fused:
        megatron_rl_patches.apply(only=FUSED)
    try:
        with kit.slime_session(*routing.MOE_ARGV, rollout_temperature=TEMPERATURE, use_rollout_entropy=True,
                               entropy_coef=0.01, log_probs_chunk_size=4, **routing.MOE_VALUES) as args:
            model, optimizer, scheduler = routing.build(args)
            replays = RoutingReplay.all_routing_replays
            assert len(replays) == 2  # one per MoE layer
            data = kit.rollout(0)
            own = kit.log_probs(args, model, data)  # records the routes
            for replay in replays:
                replay.top_indices_list = [(t.long() + 1) % EXPERTS for t in replay.top_indices_list]
            RoutingReplay.clear_all_forward()
            monkeypatch.setenv("ROUTING_REPLAY_STAGE", "replay_forward")
            out = kit.log_probs(args, model, data)
            RoutingReplay.clear_all_forward()
            monkeypatch.setenv("ROUTING_REPLAY_STAGE", "fallthrough")  # slime's train_actor: replay in the step
            step_data = kit.rollout(0, [lp + 0.05 for lp in out["log_probs"]])
            for chunk in model:
                chunk.train()
            losses, grad_norm = slime_model.train_one_step(args, 0, 0, kit.iterators(step_data), model, optimizer,
                                                           scheduler, 2, 4)
            assert all(r.forward_index == len(r.top_indices_list) == 2 for r in replays)  # each route popped once
            weights = [p.detach().clone() for p in model[0].parameters()]
    finally:
        megatron_rl_patches.revert()
    return own, out, losses, grad_norm, weights


@layouts.mark("thd")
def test_routing_replay_fused_matches_slime_and_the_routes_matter(slime_cpu, monkeypatch, caplog):
    import slime_standins

    slime_standins.cpu_pinned_memory(monkeypatch)
    _kits()[1].patch_router(monkeypatch)
    plain_own, plain, plain_losses, plain_norm, plain_weights = _replayed(monkeypatch, fused=False)
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        fused_own, fused, fused_losses, fused_norm, fused_weights = _replayed(monkeypatch, fused=True)
    assert not [r for r in caplog.records if "slime_fused:" in r.getMessage()]  # no fallback
    for key in ("log_probs", "entropy"):
        for a, b in zip(plain[key], fused[key], strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
    for a, b in zip(plain_own["log_probs"], fused_own["log_probs"], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
    # the negative control: the replayed (perturbed) routes move the fused log-probs
    moved = max(float((b - a).abs().max()) for a, b in zip(fused_own["log_probs"], fused["log_probs"]))
    assert moved > 1e-2, moved
    assert set(fused_losses) == set(plain_losses)
    for key in plain_losses:
        torch.testing.assert_close(torch.as_tensor(fused_losses[key]), torch.as_tensor(plain_losses[key]),
                                   rtol=1e-5, atol=2e-6)
    assert abs(fused_norm - plain_norm) <= 1e-5 * max(1.0, plain_norm)
    # Adam's first step moves each weight by ~lr = 0.01: fp32 noise stays far below a wrong step's 0.02
    for a, b in zip(plain_weights, fused_weights, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
