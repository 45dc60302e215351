"""docs/recipes.md's shared-prefix blocks as a new user pastes them (issue 119 item 6: the page had
no MEGATRON_RL_PATCHES_SHARED_PREFIX at all): one block per framework, each turning the patches and
the setting on where that framework's workers read them (slime: the job's runtime_env, which its
rollout manager reads, and --train-env-vars; verl: every Ray actor's runtime_env; NeMo-RL: the
driver's environment, which it hands its workers), with the framework's setting the sharing plan
needs (slime's dropout and MLA's unfused RoPE, verl's packed layout, NeMo-RL's sequence packing).
slime's flags are parsed by slime's own parser in the slime lane
(tests/integrations/slime/lane/test_slime_shared_prefix_recipe_lane.py); verl's keys are found in
verl's config in the verl lane (below)."""
from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO  # noqa: E402
from doc_recipes import SHARED_PREFIX, overrides, section_blocks, slime_job  # noqa: E402
from doc_servers import commands  # noqa: E402

from megatron_rl_patches.settings import SELECT, shared_prefix_setting  # noqa: E402
from megatron_rl_patches.settings import SHARED_PREFIX as SETTING

VERL_ENV = "+ray_kwargs.ray_init.runtime_env.env_vars."
FRAMEWORKS = ("slime", "verl", "NeMo-RL", "A hand-written loop")


def block(framework: str):
    (only,) = section_blocks(f"### {framework}: a group's prompt once")
    return only


def on(variables: dict[str, str]) -> bool:
    """The patches selected (all of them) and the setting read as on."""
    return variables.get(SELECT) == "all" and shared_prefix_setting(variables.get(SETTING))


def test_the_section_gives_one_block_per_framework_and_links_every_framework_at_every_layout():
    text = (REPO / "docs" / "recipes.md").read_text(encoding="utf-8")
    headings = [line for line in text.splitlines() if line.startswith("### ") and "a group's prompt once" in line]
    assert headings == [f"### {framework}: a group's prompt once" for framework in FRAMEWORKS]
    part = text.split(f"\n{SHARED_PREFIX}\n", 1)[1].split("\n## ", 1)[0]
    assert "](shared-prefix.md#every-framework-at-every-layout)" in part  # the matrix docs/shared-prefix.md writes
    assert "[below](#a-groups-prompt-once-shared-prefix-packing)" in text.split("\n## slime\n", 1)[0]
    assert [block(framework).lang for framework in FRAMEWORKS] == ["bash", "bash", "bash", "python"]


def test_slimes_job_sets_both_variables_where_its_rollout_manager_and_training_actors_read_them():
    variables, argv, added = slime_job(block("slime"))
    assert on(variables) and set(variables) == {SELECT, SETTING}
    assert argv[:2] == ["python3", "train.py"]
    given = dict(zip(argv[2:], argv[3:]))
    assert json.loads(given["--train-env-vars"]) == variables  # the training actors': the same two
    assert given["--attention-dropout"] == given["--hidden-dropout"] == "0.0"  # Megatron-LM's default 0.1
    assert "--use-dynamic-batch-size" in argv and int(given["--max-tokens-per-gpu"]) > 0
    assert added == ["--no-rope-fusion"] and "# with --multi-latent-attention" in block("slime").text


def test_the_dropout_slimes_block_turns_off_is_one_the_sharing_plan_refuses(megatron_cpu):
    """Megatron-LM's default dropout (0.1) is refused by name in training; the block's 0.0 runs."""
    from megatron_rl_patches.shared_prefix.refusals import config_reason

    default = megatron_cpu.config(hidden_dropout=0.1, attention_dropout=0.1)
    assert "dropout" in (config_reason(default, training=True) or "")
    assert config_reason(megatron_cpu.config(hidden_dropout=0.0, attention_dropout=0.0), training=True) is None


def verl_overrides() -> dict[str, str]:
    (command,) = commands(block("verl"))
    words = shlex.split(command)
    assert words[:4] == ["python3", "-m", "verl.trainer.main_ppo", "--config-name=ppo_megatron_trainer"], words
    return overrides(words[4:])


def test_verls_command_puts_both_variables_in_every_actor_and_packs_its_micro_batches():
    given = verl_overrides()
    variables = {key.removeprefix(VERL_ENV): value for key, value in given.items() if key.startswith(VERL_ENV)}
    assert on(variables) and set(variables) == {SELECT, SETTING}
    assert given["actor_rollout_ref.model.use_remove_padding"] == "True"


@pytest.mark.verl
def test_each_key_of_verls_shared_prefix_command_is_a_key_of_verls_config():
    """verl 0.9.1's generated trainer config (the verl lane) holds the key the command sets (its
    default there is the packed layout; verl 0.8's was the padded one)."""
    pytest.importorskip("verl.trainer.config", reason="verl's config: the verl lane (make test-verl)")
    from omegaconf import OmegaConf
    from verl.trainer import config as verl_config

    config = OmegaConf.load(os.path.join(os.path.dirname(verl_config.__file__), "_generated_ppo_megatron_trainer.yaml"))
    keys = [key for key in verl_overrides() if not key.startswith("+")]
    assert keys == ["actor_rollout_ref.model.use_remove_padding"]
    assert OmegaConf.select(config, keys[0], default=KeyError) in (True, False)


def test_nemo_rls_job_sets_both_variables_and_sequence_packing():
    from megatron_rl_patches.integrations import default_registry

    (command,) = commands(block("NeMo-RL"))
    words = [w for w in shlex.split(command) if w != "..."]
    start = words.index("uv")
    assert on(dict(w.split("=", 1) for w in words[:start]))  # the driver's, which NeMo-RL hands every worker
    assert "nemo_rl_shared_prefix" in default_registry().patch_names()
    argv = words[start:]
    assert argv[:5] == ["uv", "run", "examples/run_grpo.py", "--config", "examples/configs/grpo_math_1B_megatron.yaml"]
    assert overrides(argv[5:]) == {"policy.sequence_packing.enabled": "True"}
    assert "`policy.megatron_cfg.apply_rope_fusion=False`" in " ".join(
        (REPO / "docs" / "recipes.md").read_text(encoding="utf-8").split("### NeMo-RL: a group's prompt once", 1)[1]
        .split("```", 1)[0].split())


def test_the_hand_written_loop_calls_what_the_worked_examples_run():
    text = block("A hand-written loop").text
    for call in ("check_shared_prefix(model, training=True)", "prepare_shared_prefix(model)",
                 'plan_shared_prefix(batch["tokens"], batch["cu_seqlens"])', "shared_prefix_params(plan)"):
        assert call in text, call
        assert call.split("(")[0] in (REPO / "examples" / "shared_prefix_cpu.py").read_text(encoding="utf-8")
