"""docs/recipes.md's slime block for shared-prefix packing (issue 119 item 6), its flags parsed by
slime's own parser (Megatron-LM's with slime's extra arguments, then slime's validate_args) and
turned into the model's config as Megatron-LM turns them (`core_transformer_config_from_args`): with
the block's flags a dense model and a DeepSeek-shaped one (multi-latent attention, with the flag
the block's comment adds) run a sharing plan in training; with Megatron-LM's defaults in their
place (dropout 0.1, the fused RoPE) the sharing plan refuses each by name."""
from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import pytest

pytestmark = pytest.mark.slime

DOCS_TESTS = Path(__file__).resolve().parents[3] / "docs"
RECIPE_FLAGS = ("--attention-dropout", "--hidden-dropout")  # valued flags the lane's own argv sets
RECIPE_SWITCHES = ("--no-rope-fusion",)


def _recipe() -> tuple[list[str], list[str]]:
    """(slime's flags after `train.py` in the block, the flags its comment adds for MLA)."""
    sys.path.insert(0, str(DOCS_TESTS))
    try:
        from doc_recipes import section_blocks, slime_job
    finally:
        sys.path.remove(str(DOCS_TESTS))
    (block,) = section_blocks("### slime: a group's prompt once")
    _, argv, added = slime_job(block)
    return argv[argv.index("train.py") + 1:], added


def _config(*flags: str):
    """The model config slime's parser makes of the lane's tiny model with `flags`, the lane's own
    dropout and RoPE-fusion flags left out (Megatron-LM's defaults where `flags` do not set them).
    megatron-core refuses a fused RoPE config where Transformer Engine's kernel is missing (CPU): a
    stand-in kernel is named while the config is made, as Transformer Engine names it on a GPU."""
    import slime_kit
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.training.arguments import core_transformer_config_from_args
    from slime_prefix_cases import DEEPSEEK_SHAPED

    base, skip = [], 0
    for word in slime_kit.ARGV:
        if skip:
            skip -= 1
        elif word in RECIPE_FLAGS:
            skip = 1
        elif word not in RECIPE_SWITCHES:
            base.append(word)
    assert set(DEEPSEEK_SHAPED).isdisjoint(RECIPE_FLAGS + RECIPE_SWITCHES)
    with mock.patch.object(slime_kit, "ARGV", tuple(base)):
        args = slime_kit.slime_args(*flags)
    kernel = rope_utils.fused_apply_rotary_pos_emb or (lambda *a, **k: None)
    with mock.patch.object(rope_utils, "fused_apply_rotary_pos_emb", kernel):
        return args, core_transformer_config_from_args(args)


def test_the_blocks_flags_give_a_config_the_sharing_plan_runs_and_the_defaults_one_it_refuses(slime_cpu):
    from slime_prefix_cases import DEEPSEEK_SHAPED

    from megatron_rl_patches.shared_prefix.refusals import config_reason

    flags, added = _recipe()
    assert added == ["--no-rope-fusion"]
    args, dense = _config(*flags)
    assert args.use_dynamic_batch_size and args.max_tokens_per_gpu == 9216 and args.variable_seq_lengths
    assert args.train_env_vars == {"MEGATRON_RL_PATCHES": "all", "MEGATRON_RL_PATCHES_SHARED_PREFIX": "1"}
    assert config_reason(dense, training=True) is None
    _, latent = _config(*flags, *DEEPSEEK_SHAPED, *added)
    assert latent.multi_latent_attention and not latent.apply_rope_fusion
    assert config_reason(latent, training=True) is None
    # without the block's flags: Megatron-LM's defaults, each refused by name
    _, defaults = _config()
    assert (defaults.hidden_dropout, defaults.attention_dropout) == (0.1, 0.1)
    assert "dropout" in (config_reason(defaults, training=True) or "")
    # Megatron-LM's fused RoPE (its default) on MLA: megatron-core takes it with YaRN only, DeepSeek-V3's
    yarn = ("--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "1.0", "--mscale-all-dim", "1.0")
    _, fused = _config(*flags, *DEEPSEEK_SHAPED, *yarn)
    assert fused.apply_rope_fusion and "apply_rope_fusion" in (config_reason(fused, training=True) or "")
    _, unfused = _config(*flags, *DEEPSEEK_SHAPED, *yarn, *added)
    assert config_reason(unfused, training=True) is None
