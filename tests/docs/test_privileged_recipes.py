"""docs/privileged-teachers.md's framework recipes as a new user pastes them: the hand-written loop
names its interpreter (and prints no warnings: doc_fresh.QUIET_PAGES); slime's job passes
`slime_opd`'s own checks (its settings read from the job's variables, its flags), the variables in
the job's runtime_env rather than `export` lines; each verl command is verl's distillation with the
patches and an entry verl's parsers take (the live self-teacher with the fused route off, which it
needs), each override a key of verl's config (the verl lane); NeMo-RL's three teachers, the
in-process θ₀ among them."""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO, page_blocks  # noqa: E402
from doc_servers import commands  # noqa: E402

PAGE = REPO / "docs" / "privileged-teachers.md"
BLOCKS = page_blocks(PAGE)
VERL_PREFIX = "+ray_kwargs.ray_init.runtime_env.env_vars."


def section(title: str) -> list:
    """The page's blocks under `## title`."""
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return [b for b in BLOCKS if start < b.line <= end]


def test_the_hand_written_loop_says_which_interpreter_runs_it():
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    first = next(b for b in BLOCKS if b.kind == "python")
    before = " ".join(lines[first.line - 6:first.line - 1])
    assert "`.venv/bin/python`" in before and "make venv" in before, before


def slime_job() -> tuple[dict[str, str], list[dict[str, str]], list[str]]:
    """(the job's variables, each commented alternative's, slime's argv) of the slime section's job block."""
    (block,) = [b for b in section("slime") if b.lang == "bash"]
    (env_line,) = [c for c in commands(block) if c.startswith("ENV=")]
    variables = json.loads(shlex.split(env_line)[0].removeprefix("ENV="))
    alternatives = [{**variables, **json.loads("{" + line.strip().lstrip("#").strip() + "}")}
                    for line in block.text.splitlines() if re.match(r"#\s+\"MEGATRON_RL_PATCHES", line)]
    (submit,) = [c for c in commands(block) if c.startswith("ray job submit")]
    return variables, alternatives, shlex.split(submit)


def test_the_slime_job_puts_its_variables_in_the_jobs_runtime_env_and_the_training_actors():
    variables, alternatives, argv = slime_job()
    assert "export" not in " ".join(argv) and len(alternatives) == 2
    assert '--runtime-env-json={"env_vars": $ENV}' in argv and argv[argv.index("--train-env-vars") + 1] == "$ENV"
    assert variables["MEGATRON_RL_PATCHES"] == "all"


def test_the_slime_job_passes_slime_opds_own_checks(monkeypatch):
    """Each teacher the block offers (the live self-teacher, the frozen θ₀ snapshot, θ₀ served),
    read by slime_opd from the job's variables and checked with the block's flags as slime_opd
    checks them before the first step (a missing `--loss-type custom_loss` is refused there)."""
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
    from megatron_rl_patches.integrations.slime.opd import check_args

    variables, alternatives, argv = slime_job()
    flags = argv[argv.index("--") + 1:]

    def flag(name: str) -> str:
        return flags[flags.index(name) + 1]

    args = argparse.Namespace(loss_type=flag("--loss-type"), rollout_temperature=1.0,
                              custom_loss_function_path=flag("--custom-loss-function-path"),
                              metadata_key=flag("--metadata-key"))
    for env in [variables, *alternatives]:
        for name in [n for n in list(os.environ) if n.startswith("MEGATRON_RL_PATCHES_OPD_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        settings = opd_settings()
        assert settings is not None and settings.teachers[0].context == "solution", env
        check_args(args, settings)  # raises ValueError naming what slime_opd refuses
    assert flag("--custom-generate-function-path") == "my_rollout.generate_with_solution"


def verl_commands() -> list[dict[str, str]]:
    """Each verl command of the verl section: its overrides, name -> value."""
    (block,) = [b for b in section("verl") if b.lang == "bash"]
    found = []
    for command in commands(block):
        words = shlex.split(command)
        assert words[:3] == ["python3", "-m", "verl.trainer.main_ppo"], command
        found.append(dict(word.split("=", 1) for word in words[3:] if "=" in word and not word.startswith("--")))
    return found


def test_each_verl_command_is_verls_distillation_with_the_patches_and_an_entry_verl_takes():
    from megatron_rl_patches.integrations.verl.entry import parse_entry
    from megatron_rl_patches.settings import VERL_TEACHER
    from megatron_rl_patches.teachers.kinds import student

    runs = verl_commands()
    assert len(runs) == 2
    for overrides in runs:
        assert overrides["distillation.enabled"] == "True"
        assert overrides["distillation.distillation_loss.loss_mode"] == "forward_kl_topk"
        assert overrides["distillation.teacher_models.teacher_model.model_path"]
        assert overrides[f"{VERL_PREFIX}MEGATRON_RL_PATCHES"] == "all"
        entry = overrides[f"{VERL_PREFIX}{VERL_TEACHER}"]
        if student.recognizes(entry):  # the live self-teacher: verl's fused route has no logits processor for it
            assert overrides["actor_rollout_ref.model.use_fused_kernels"] == "False"
            with pytest.MonkeyPatch.context() as patch:
                from megatron_rl_patches.integrations.verl.entry import verl_teacher

                patch.setenv(VERL_TEACHER, entry)
                assert verl_teacher(types.SimpleNamespace()).self_teacher == ("solution", "/ckpt/student")
        else:
            assert parse_entry(entry).context == "solution"
    assert {student.recognizes(o[f"{VERL_PREFIX}{VERL_TEACHER}"]) for o in runs} == {True, False}


def test_the_page_says_the_live_self_teacher_needs_the_fused_route_off_where_the_smallest_change_turns_it_on():
    text = " ".join(PAGE.read_text(encoding="utf-8").split("## verl\n", 1)[1].split("\n## ", 1)[0].split())
    assert "`actor_rollout_ref.model.use_fused_kernels=False`" in text and "smallest change" in text
    recipes = (REPO / "docs" / "recipes.md").read_text(encoding="utf-8").split("## verl\n", 1)[1]
    assert "use_fused_kernels=True" in recipes.split("```", 2)[1]  # what the smallest change turns on


@pytest.mark.verl
def test_each_verl_override_is_a_key_of_verls_config():
    """verl 0.9.1's generated trainer config (the verl lane) holds every key the commands set (a
    `+` key is an addition, ray_kwargs' runtime_env)."""
    pytest.importorskip("verl.trainer.config", reason="verl's config: the verl lane (make test-verl)")
    from omegaconf import OmegaConf
    from verl.trainer import config as verl_config

    config = OmegaConf.load(os.path.join(os.path.dirname(verl_config.__file__), "_generated_ppo_megatron_trainer.yaml"))
    missing = [key for overrides in verl_commands() for key in overrides
               if not key.startswith("+") and OmegaConf.select(config, key, default=KeyError) is KeyError]
    assert missing == []


def test_nemo_rls_block_offers_its_three_teachers_the_in_process_theta0_among_them():
    (block,) = [b for b in section("NeMo-RL") if b.lang == "python"]
    for route, policy in (("privileged_teacher_in_setup", "privileged_teacher_policy"),
                          ("served_teacher_in_setup", "served_teacher_policy"),
                          ("self_teacher_in_setup", "self_teacher_policy")):
        assert f"{route}({policy}(" in block.text, route
    assert "with route:" in block.text and "distillation_train(" in block.text
