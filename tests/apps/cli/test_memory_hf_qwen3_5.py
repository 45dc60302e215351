"""`memory --hf` on the published config.json of Qwen3.5-27B, Qwen3.5-35B-A3B (vision-language
wrappers) and Qwen3-Next-80B-A3B (fixtures in hf_configs/): exact counts pinned under the
convention of test_memory_hf_families.py (the text model's tensors with the input embedding and
the output layer; "active" is what one token runs), the vision tower counted apart (never built),
and the published totals to their rounding: Qwen3.5's model cards count text plus vision (27B,
35B), Qwen3-Next's 80B is text only; "A3B" is 3B active per token with the embedding and output
tables for Qwen3.5-35B-A3B (3.45B; 2.44B without) and without them for Qwen3-Next (3.25B; 3.87B with)."""

import pytest
from kit.published_configs import published_config

from megatron_rl_patches.apps.cli import main
from megatron_rl_patches.inference.loading.hf.memory_plan import hf_memory_plan

# file -> (text total, active per token, vision tower) exact, as counted here
PINNED = {
    "Qwen3.5-27B": (26_895_998_464, 26_895_998_464, 460_730_096),
    "Qwen3.5-35B-A3B": (34_660_610_688, 3_454_988_928, 446_571_248),
    "Qwen3-Next-80B-A3B": (79_674_391_296, 3_874_929_408, 0),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_exact_counts_text_and_vision_apart(name, published):
    plan = hf_memory_plan(published(name))
    assert (plan.total_params, plan.active_params, plan.vision_params) == PINNED[name]


def test_published_totals_to_their_rounding(published):
    plans = {name: hf_memory_plan(published(name)) for name in PINNED}

    def tables(name):
        config = published_config(name)
        text = config.get("text_config", config)
        return 2 * text["vocab_size"] * text["hidden_size"]

    dense, moe, nxt = plans["Qwen3.5-27B"], plans["Qwen3.5-35B-A3B"], plans["Qwen3-Next-80B-A3B"]
    assert round((dense.total_params + dense.vision_params) / 1e9) == 27
    assert round((moe.total_params + moe.vision_params) / 1e9) == 35 and round(moe.active_params / 1e9) == 3
    assert round(nxt.total_params / 1e9) == 80
    assert round((nxt.active_params - tables("Qwen3-Next-80B-A3B")) / 1e9) == 3


def test_a_27b_teacher_per_residency_mode(published):
    """The PRM-teacher scenario: Qwen3.5-27B in bf16 on one GPU resident (50 GiB) or streamed a layer
    at a time with one prefetched (the output layer and two of the widest layers, 3.8 GiB)."""
    plan = hf_memory_plan(published("Qwen3.5-27B"))
    table = 248_320 * 5120  # the vocab is a multiple of 128 already
    assert plan.padded_vocab == 248_320 and plan.embedding_params == table
    assert plan.mode("resident").device_peak == plan.total_params * 2
    assert plan.mode("stream").device_peak == (2 * plan.layer_params + table + 5120) * 2  # output layer + final norm
    assert plan.layer_params == 383_273_184  # a full-attention layer, the widest of the model


def test_table_says_the_vision_tower_is_not_built(capsys, published):
    assert main(["memory", "--hf", str(published("Qwen3.5-35B-A3B")), "--tp", "2", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    assert ("(qwen3_5_moe): 34,660,610,688 parameters, 3,454,988,928 active per token (text; the vision tower's "
            "446,571,248 are not built)") in out
