"""`memory --hf` on the published config.json of the multi-latent attention teachers (fixtures in
hf_configs/: DeepSeek-V3, Kimi-K2-Instruct, Moonlight-16B-A3B, GLM-4.7-Flash; FP8 or not, counted as parameters of
the build's dtype): exact counts pinned, and the published totals to their rounding. Convention: the
checkpoint's tensors with the input embedding and the output layer, MTP layers apart; "active" is
what one token runs. The model cards count the total with both tables and the active parameters
without the input embedding (a lookup): 671B / 37B, "1T" / 32B, 16B / 3B."""

import pytest
from kit.published_configs import published_config

from megatron_rl_patches.apps.cli import main
from megatron_rl_patches.inference.loading.hf.fp8 import fp8_disk_bytes
from megatron_rl_patches.inference.loading.hf.memory_plan import hf_memory_plan

PINNED = {  # file -> (total, active) exact, as counted here
    "DeepSeek-V3": (671_026_419_200, 37_552_297_472),
    "Kimi-K2-Instruct": (1_026_408_232_448, 32_861_500_928),
    "Moonlight-16B-A3B": (15_960_110_208, 2_914_776_192),
    "GLM-4.7-Flash": (29_943_393_920, 3_896_766_080),
}
PUBLISHED = {"DeepSeek-V3": (671, 37), "Kimi-K2-Instruct": (1000, 32), "Moonlight-16B-A3B": (16, 3)}  # billions


@pytest.mark.parametrize("name", sorted(PINNED))
def test_exact_counts(name, published):
    plan = hf_memory_plan(published(name))
    assert (plan.total_params, plan.active_params) == PINNED[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_totals_to_their_rounding(name, published):
    config = published_config(name)
    plan = hf_memory_plan(published(name))
    total, active = PUBLISHED[name]
    digits = -3 if total >= 1000 else 0  # Kimi-K2's "1T"
    assert round(plan.total_params / 1e9, digits) == total
    assert round((plan.active_params - config["vocab_size"] * config["hidden_size"]) / 1e9) == active


def test_glm_4_7_flash_published_30b_a3b(published):
    """GLM-4.7-Flash ("30B-A3B"; 47 layers, the first dense, 64 experts of which 4 + 1 shared run,
    one MTP layer counted apart): 29.94B total; active 3.58B with the output layer, 3.26B without
    either table, which is the published ~3B (the name truncates)."""
    config = published_config("GLM-4.7-Flash")
    plan = hf_memory_plan(published("GLM-4.7-Flash"))
    table = config["vocab_size"] * config["hidden_size"]
    assert round(plan.total_params / 1e9) == 30
    assert round((plan.active_params - 2 * table) / 1e9) == 3
    assert round((plan.active_params - table) / 1e9, 2) == 3.58


FP8_BYTES = {"DeepSeek-V3": 673_150_582_112, "Kimi-K2-Instruct": 1_029_173_203_808, "Moonlight-16B-A3B": None,
             "GLM-4.7-Flash": None}


@pytest.mark.parametrize("name", sorted(FP8_BYTES))
def test_fp8_bytes_on_disk(name, published):
    """float8 weights (1 byte) with a float32 scale per 128 x 128 block, the rest bf16: just over a
    byte per parameter; Moonlight and GLM-4.7-Flash ship bf16 (None)."""
    got = fp8_disk_bytes(published(name))
    assert got == FP8_BYTES[name]
    if got is not None:
        assert 1.0 < got / hf_memory_plan(published(name)).total_params < 1.01


def test_table_names_the_family_and_the_fp8_bytes(capsys, published):
    assert main(["memory", "--hf", str(published("DeepSeek-V3")), "--tp", "8", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    assert "(deepseek_v3): 671,026,419,200 parameters, 37,552,297,472 active per token" in out
    assert "FP8 checkpoint: 673,150,582,112 bytes on disk (626.92 GiB), built at bf16" in out
