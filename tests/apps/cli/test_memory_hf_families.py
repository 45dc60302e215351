"""`memory --hf` on the published config.json of the teachers users download (fixtures in
hf_configs/): exact counts pinned, and the published totals to their rounding. Convention: the
checkpoint's tensors with the input embedding and the output layer, MTP layers apart; "active" is
what one token runs (its experts, the shared ones, the dense layers). GLM's model cards count
without the embedding and output tables: GLM-4.5's 355B also counts its MTP layer, GLM-4.5-Air's
106B does not (with it, 108.0B)."""

import pytest
from kit.published_configs import published_config

from megatron_rl_patches.apps.cli import main
from megatron_rl_patches.inference.loading.hf.memory_plan import hf_memory_plan

# file -> (total, active) exact, as counted here
PINNED = {
    "Llama-3.1-8B": (8_030_261_248, 8_030_261_248),
    "Llama-3.1-70B": (70_553_706_496, 70_553_706_496),
    "Mixtral-8x7B-v0.1": (46_702_792_704, 12_879_925_248),
    "GLM-4.5": (352_797_829_024, 33_632_266_144),
    "GLM-4.5-Air": (106_852_251_264, 13_424_129_664),
}


def _round(value: float, digits: int) -> float:
    return round(value / 1e9, digits)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_exact_counts(name, published):
    plan = hf_memory_plan(published(name))
    assert (plan.total_params, plan.active_params) == PINNED[name]


def test_published_totals_to_their_rounding(published):
    plans = {name: hf_memory_plan(published(name)) for name in PINNED}
    assert _round(plans["Llama-3.1-8B"].total_params, 2) == 8.03
    assert _round(plans["Llama-3.1-70B"].total_params, 1) == 70.6
    mixtral = plans["Mixtral-8x7B-v0.1"]
    assert (_round(mixtral.total_params, 1), _round(mixtral.active_params, 1)) == (46.7, 12.9)
    for name, published in (("GLM-4.5", (355, 32)), ("GLM-4.5-Air", (106, 12))):
        config = published_config(name)
        h = config["hidden_size"]
        tables = 2 * config["vocab_size"] * h
        plan = plans[name]
        moe_layer = plan.layer_params  # the largest layer at TP=EP=1: a MoE one
        mtp = moe_layer + 2 * h * h + 3 * h  # a MoE layer, eh_proj and its enorm / hnorm / shared_head norm
        total = plan.total_params - tables + (mtp if name == "GLM-4.5" else 0)
        assert (round(total / 1e9), round((plan.active_params - tables) / 1e9)) == published


def test_table_names_the_family(capsys, published):
    assert main(["memory", "--hf", str(published("GLM-4.5")), "--tp", "8", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    assert "(glm4_moe): 352,797,829,024 parameters, 33,632,266,144 active per token" in out
