"""slime 624b824a's routing replay (`ENABLE_ROUTING_REPLAY=1`, `--use-rollout-routing-replay`) with
MEGATRON_RL_PATCHES_SHARED_PREFIX=1 (issue 121 item 4), on the lane's MoE student (4 experts, top-2)
with slime's router patch, over GRPO rollouts (two groups of four sharing their group's prompt, a
micro-batch each): routes recorded by slime's real forward_only, then perturbed as a rollout engine's
records would differ (every token's experts shifted by one; one member's 10th prompt token at
layer 1 replayed other experts), replayed by forward_only and by train_one_step (slime's stages as
its actor sets them). The setting off vs on: the recorded log-probs, the replayed log-probs and
entropy, the losses, the gradient norm and the weights after the step within 1e-6 of their scale;
the ids the model embeds fewer with the setting on; the negative control: the perturbed routes move
the log-probs."""
from __future__ import annotations

import logging

import pytest
import torch

from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.slime

import megatron_rl_patches  # noqa: E402

FUSED = ["slime_fused", "gpt_output_processor"]
EXPERTS = 4
TOL = 1e-6
LINEAR_ADAM = ("--adam-eps", "1.0")  # an update about lr · gradient (see test_slime_shared_prefix_lane.py)
PARTED = (1, 24 + 5 + 9)  # (layer, row of micro-batch 0): the second member's 10th prompt token


def _embedded(model) -> list[int]:
    """Counts the ids each forward of `model`'s chunk embeds (a list the hook appends to)."""
    counts: list[int] = []
    for module in model[0].modules():
        if type(module).__name__ == "LanguageModelEmbedding":
            module.register_forward_pre_hook(lambda m, args, kwargs: counts.append(int(
                (args[0] if args else kwargs["input_ids"]).numel())), with_kwargs=True)
    return counts


def _run(monkeypatch, on: bool) -> dict:
    import slime_kit as kit
    import slime_routing as routing
    from slime.backends.megatron_utils import model as slime_model
    from slime.utils.routing_replay import RoutingReplay
    from slime_prefix_cases import grpo_rollouts

    monkeypatch.setattr(RoutingReplay, "all_routing_replays", [])
    monkeypatch.setenv("ENABLE_ROUTING_REPLAY", "1")
    monkeypatch.setenv("ROUTING_REPLAY_STAGE", "record")
    monkeypatch.setenv("MEGATRON_RL_PATCHES_SHARED_PREFIX", "1" if on else "0")
    megatron_rl_patches.apply(only=FUSED)
    try:
        with kit.slime_session(*routing.MOE_ARGV, *LINEAR_ADAM, "--global-batch-size", "8",
                               use_rollout_routing_replay=True, use_routing_replay=True, **routing.MOE_VALUES) as args:
            model, optimizer, scheduler = routing.build(args)
            embedded = _embedded(model)
            replays = RoutingReplay.all_routing_replays
            assert len(replays) == 2  # one per MoE layer
            data = grpo_rollouts(kit.VOCAB)[0]  # two micro-batches, a group each
            own = kit.log_probs(args, model, data)  # records the routes (under the plan: the packed rows)
            recorded = [[t.clone() for t in r.top_indices_list] for r in replays]
            for replay in replays:
                replay.top_indices_list = [(t.long() + 1) % EXPERTS for t in replay.top_indices_list]
            layer, row = PARTED
            first = int(replays[layer].top_indices_list[0][row, 0])
            replays[layer].top_indices_list[0][row] = torch.tensor([(first + 1) % EXPERTS, (first + 2) % EXPERTS])
            RoutingReplay.clear_all_forward()
            monkeypatch.setenv("ROUTING_REPLAY_STAGE", "replay_forward")  # the actor's old log-prob pass
            replayed = kit.log_probs(args, model, data)
            RoutingReplay.clear_all_forward()
            monkeypatch.setenv("ROUTING_REPLAY_STAGE", "replay_backward")  # the actor's stage around train()
            step_data = {**data, "log_probs": [lp + 0.05 for lp in replayed["log_probs"]]}
            for chunk in model:
                chunk.train()
            losses, grad_norm = slime_model.train_one_step(args, 0, 0, kit.iterators(step_data), model, optimizer,
                                                           scheduler, 2, 8)
            assert all(r.forward_index == len(r.top_indices_list) == 2 for r in replays)  # each record popped once
            weights = [p.detach().clone() for p in model[0].parameters()]
    finally:
        megatron_rl_patches.revert()
    return {"own": own["log_probs"], "recorded": recorded, "log_probs": replayed["log_probs"],
            "entropy": replayed.get("entropy"), "losses": {k: float(v) for k, v in losses.items()},
            "grad_norm": float(grad_norm), "weights": weights, "embedded": embedded}


@layouts.mark("thd", "moe")
def test_routing_replay_with_the_setting_on_equals_it_off_and_embeds_fewer_ids(slime_cpu, monkeypatch, caplog):
    import slime_routing as routing
    import slime_standins
    from slime_prefix_cases import close

    slime_standins.cpu_pinned_memory(monkeypatch)
    routing.patch_router(monkeypatch)
    off = _run(monkeypatch, on=False)
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        on = _run(monkeypatch, on=True)
    assert not [r.getMessage() for r in caplog.records if "packed whole" in r.getMessage()]
    parted = [r.getMessage() for r in caplog.records if "recorded MoE routes differ" in r.getMessage()]
    assert len(parted) == 1 and "(samples 1)" in parted[0], parted  # the second member parts at its 10th token
    for key in ("own", "recorded", "log_probs", "entropy", "losses", "grad_norm", "weights"):
        assert close(on[key], off[key], TOL), key
    moved = max(float((b - a).abs().max()) for a, b in zip(on["own"], on["log_probs"]))
    assert moved > 1e-2, moved  # the replayed routes are not the router's own
    # every pass embeds each group's prompt once with the setting on (the parted member's rest its own)
    assert sum(on["embedded"]) < sum(off["embedded"]) - 3 * (24 + 28), (on["embedded"], off["embedded"])
