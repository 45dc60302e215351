"""What verl's engine settings make of a pass with MEGATRON_RL_PATCHES_SHARED_PREFIX=1
(`integrations/verl/shared_prefix.verl_layout`, read through the shared-prefix table): context and
pipeline parallelism share (the door rebuilds the whole micro-batch), so they give no reason; what
verl's layout cannot share is named with the verl setting to change, each alone. The lane
(tests/integrations/verl/lane/test_verl_layouts.py) runs verl's real engine at CP = 2, PP = 2 and
CP = 2 x TP = 2, and the fallback and the STRICT error over two ranks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl_patches.integrations.shared_prefix_doors.decision import pass_verdict


def engine(hf_config=None, mtp=None, **config):
    engine_config = SimpleNamespace(use_remove_padding=True, dynamic_context_parallel=False,
                                    router_replay=SimpleNamespace(mode="disabled"))
    for key, value in config.items():
        setattr(engine_config, key, value)
    return SimpleNamespace(engine_config=engine_config, model_config=SimpleNamespace(hf_config=hf_config, mtp=mtp))


def verdict(eng) -> list[str]:
    from megatron_rl_patches.integrations.verl.shared_prefix import verl_layout

    return [reason.said() for reason in pass_verdict("verl", verl_layout(eng))]


def test_a_plain_layout_has_no_reason():
    assert verdict(engine()) == []
    assert verdict(engine(hf_config=SimpleNamespace(architectures=["Qwen2ForCausalLM"]))) == []


@pytest.mark.parametrize(("eng", "named", "change"), [
    (engine(use_remove_padding=False), "use_remove_padding=False", "actor_rollout_ref.model.use_remove_padding=True"),
    (engine(dynamic_context_parallel=True), "dynamic context parallelism",
     "actor_rollout_ref.actor.megatron.dynamic_context_parallel=False"),
    (engine(router_replay=SimpleNamespace(mode="R3")), "router_replay.mode",
     "actor_rollout_ref.actor.megatron.router_replay.mode=disabled"),
    (engine(hf_config=SimpleNamespace(vision_config={})), "vision-language", "switch the setting off"),
], ids=["padded", "dynamic-cp", "router-replay", "vision"])
def test_each_layout_verl_cannot_share_is_named_with_verls_setting(eng, named, change):
    reasons = verdict(eng)
    assert len(reasons) == 1 and named in reasons[0] and change in reasons[0], reasons
