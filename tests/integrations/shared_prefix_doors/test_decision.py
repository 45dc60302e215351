"""The shared-prefix doors' one table and decision (integrations/shared_prefix_doors): every row has
a cell per framework, a "packed whole" cell names what to change in that framework's words, a model's
refusal is answered with the framework's own flag, and a pass that cannot share packs whole with one
warning (a ValueError under MEGATRON_RL_PATCHES_STRICT=1), never stopping a job the setting off would
run. slime's routing replay (its own router patch: no config field the model's check reads) planned
its passes before this table (the first test here failed on 9e804589); it shares at CP = 1 and one stage
now, each plan built from slime's records."""
from __future__ import annotations

import logging
import types

import pytest

from megatron_rl_patches.integrations.shared_prefix_doors.decision import changes, pass_verdict
from megatron_rl_patches.integrations.shared_prefix_doors.frameworks import FRAMEWORKS, framework
from megatron_rl_patches.integrations.shared_prefix_doors.table import FEATURES, NOT_RUN, SHARED, WHOLE, Layout

ROPE = "multi-latent attention with fused or interleaved RoPE (multi_latent_attention=True): its rotary table ..."


def _slime_args(**flags):
    from megatron_rl_patches.integrations.slime.fused_step import HELD, SlimeSettings

    return types.SimpleNamespace(**flags, **{HELD: SlimeSettings(None, True)})


def test_slimes_routing_replay_shares_at_one_stage_and_packs_whole_beside_context_parallelism(megatron_cpu, caplog):
    """slime's routing replay (issue 121 item 4): at CP = 1 and one stage its passes share, each plan built
    from the records slime replays next (`routing_replay_records.next_records`, never a step's held
    segments); beside context parallelism or under pipeline stages they pack whole with one warning in
    slime's words."""
    from megatron_rl_patches._log import forget_warnings
    from megatron_rl_patches.integrations.slime.fused_step import slime_prefix_pass
    from megatron_rl_patches.integrations.slime.routing_replay_records import next_records
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    model = build_packed_gpt(seq_length=64)
    forget_warnings()
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        shared = slime_prefix_pass(_slime_args(use_rollout_routing_replay=True), [model], "slime's training step",
                                   training=True)
        assert shared is not None and shared.records is next_records and not shared.held
        assert not [r for r in caplog.records if "packed whole" in r.getMessage()]
        for flags, named in (({"context_parallel_size": 2}, "--context-parallel-size 1"),
                             ({"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size 1")):
            forget_warnings()
            caplog.clear()
            assert slime_prefix_pass(_slime_args(use_routing_replay=True, **flags), [model], "slime's training step",
                                     training=True) is None
            said = [r.getMessage() for r in caplog.records if "packed whole" in r.getMessage()]
            assert len(said) == 1, said
            for words in ("slime's training step runs each sample packed whole", "slime's routing replay", named,
                          "drop --use-rollout-routing-replay and --use-routing-replay",
                          "MEGATRON_RL_PATCHES_SHARED_PREFIX=0", "MEGATRON_RL_PATCHES_STRICT=1"):
                assert words in said[0], (words, said[0])
    assert slime_prefix_pass(_slime_args(), [model], "slime's training step", training=True).records is None


def test_under_strict_the_same_words_raise_and_nothing_is_prepared(megatron_cpu):
    from megatron_rl_patches.integrations.megatron.shared_prefix_pass import prefix_pass
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    model = build_packed_gpt(seq_length=64)
    with pytest.raises(ValueError) as raised:
        prefix_pass("slime's log-prob pass", [model], training=False, enabled=True, framework="slime",
                    layout=Layout(vision=True), strict=True)
    message = str(raised.value)
    assert message.startswith("MEGATRON_RL_PATCHES_SHARED_PREFIX=1 with MEGATRON_RL_PATCHES_STRICT=1: slime's log-prob "
                              "pass cannot pack a group's prompt once: a vision-language model's prompt")
    assert "multimodal_train_inputs" in message and "MEGATRON_RL_PATCHES_SHARED_PREFIX=0" in message
    assert not getattr(model, "_megatron_rl_patches_shared_prefix", False)  # the model was not prepared


def test_a_models_refusal_is_answered_with_each_frameworks_own_flag():
    assert changes("slime", ROPE) == "--no-rope-fusion"
    assert changes("verl", ROPE).startswith(
        "+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=False")
    assert changes("nemo-rl", ROPE).startswith("policy.megatron_cfg.apply_rope_fusion=false")
    assert changes("megatron", ROPE) == "config.apply_rope_fusion=False"
    assert changes("slime", "a layer the plan does not know (no field)") == ""


def test_every_row_has_a_cell_per_framework_and_packed_whole_says_what_to_change():
    for row in FEATURES:
        assert set(row.cells) == set(FRAMEWORKS), row.key
        for key, cell in row.cells.items():
            assert cell.outcome in (SHARED, WHOLE, NOT_RUN), (row.key, key)
            if cell.outcome == WHOLE:
                assert cell.why and cell.change, (row.key, key)
            if cell.outcome == NOT_RUN:
                assert cell.why, (row.key, key)


@pytest.mark.parametrize(("key", "layout", "named"), [
    ("verl", Layout(packed=False), "actor_rollout_ref.model.use_remove_padding=True"),
    ("nemo-rl", Layout(packed=False), "policy.sequence_packing.enabled=true"),
    ("nemo-rl", Layout(fixed_lengths=True), "policy.megatron_cfg.pipeline_model_parallel_size=1"),
    ("slime", Layout(vision=True), "multimodal_train_inputs"),
    ("verl", Layout(routing_replay=True), "router_replay.mode=disabled"),
    ("nemo-rl", Layout(routing_replay=True), "policy.router_replay.enabled=false"),
    ("nemo-rl", Layout(mtp_training=True), "policy.megatron_cfg.mtp_num_layers=0"),
], ids=["verl-padded", "nemo-rl-padded", "nemo-rl-pipeline", "slime-vision", "verl-replay", "nemo-rl-replay",
        "nemo-rl-mtp"])
def test_a_door_row_packs_whole_in_the_frameworks_words(key, layout, named):
    reasons = pass_verdict(key, layout)
    assert len(reasons) == 1 and named in reasons[0].said(), reasons
    assert pass_verdict(key, Layout()) == []
    assert pass_verdict("verl", Layout(mtp_training=True)) == []  # verl's MTP training shares (the verl lane)


def test_an_unknown_framework_is_named_with_the_choices():
    with pytest.raises(ValueError, match="framework='deepspeed' is not one .* slime, verl, nemo-rl, megatron"):
        framework("deepspeed")


@pytest.mark.parametrize(("key", "change"), [
    ("slime", "drop --num-virtual-stages-per-pipeline-rank (--num-layers-per-virtual-pipeline-stage)"),
    ("verl", "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null"),
    ("nemo-rl", "policy.megatron_cfg.virtual_pipeline_model_parallel_size=null"),
], ids=["slime", "verl", "nemo-rl"])
def test_a_config_field_the_plan_refuses_packs_whole_in_each_frameworks_words(key, change):
    """Interleaved pipeline stages (virtual_pipeline_model_parallel_size=2), as the model's own check refuses
    them: each framework's pass packs whole naming the field and that framework's setting."""
    from megatron_rl_patches.shared_prefix.refusals import config_reasons

    config = types.SimpleNamespace(virtual_pipeline_model_parallel_size=2)
    (reason,) = config_reasons(config, training=True)
    (said,) = [r.said() for r in pass_verdict(key, Layout(), model_reason=reason)]
    assert "interleaved (virtual) pipeline stages (virtual_pipeline_model_parallel_size=2)" in said
    assert said.endswith(f"(to share: {change})"), said
