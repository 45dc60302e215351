"""docs/recipes.md's one block for slime's served teacher off the train step (issue 96 item 7), as a
user pastes it: run in bash with `ray` stubbed (its argv printed), every variable in the job's
runtime_env (none left to --train-env-vars, which would not reach the rollout manager), the
variables passing the checks `doctor`, `run` and the start-up hook run (`check_settings`), the served
teacher's replicas asked at the rollout (`rollout_entries`), and slime's flags passing the checks
`slime_opd` runs before the first step (`check_args`: the custom loss, the rollout temperature the
engine scores at). docs/variables.md (the README's table until issue 122) and docs/distillation.md
link to it; --help, the variable table and distillation.md say where SCORE_AT and the teachers are
read."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO, page_blocks  # noqa: E402

PAGE = REPO / "docs" / "recipes.md"
TITLE = "### A served teacher off the train step (slime)"
LINK = "recipes.md#a-served-teacher-off-the-train-step-slime"
KEY = "test-key-0123456789"
VARIABLES = {"MEGATRON_RL_PATCHES", "MEGATRON_RL_PATCHES_OPD_TEACHERS", "MEGATRON_RL_PATCHES_OPD_IDS_FROM",
             "MEGATRON_RL_PATCHES_OPD_K", "MEGATRON_RL_PATCHES_OPD_SCORE_AT", "MEGATRON_RL_PATCHES_TEACHER_API_KEY"}


def recipe_block():
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    start = lines.index(TITLE) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("## "))
    (block,) = [b for b in page_blocks(PAGE) if start < b.line <= end and b.lang == "bash"]
    return block


def submitted() -> list[str]:
    """The argv the block gives `ray`, run in bash as pasted (the key from the environment)."""
    script = "ray() { printf '%s\\0' \"$@\"; }\n" + recipe_block().text
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                          env={"PATH": os.environ.get("PATH", ""), "TEACHER_API_KEY": KEY})
    return done.stdout.rstrip("\0").split("\0")


@pytest.fixture(scope="module")
def job() -> tuple[dict[str, str], list[str]]:
    """(the runtime_env's variables, slime's argv after `--`)."""
    argv = submitted()
    assert argv[:2] == ["job", "submit"], argv
    (runtime_env,) = [a.removeprefix("--runtime-env-json=") for a in argv if a.startswith("--runtime-env-json=")]
    return json.loads(runtime_env)["env_vars"], argv[argv.index("--") + 1:]


def test_every_variable_is_in_the_jobs_runtime_env_and_passes_the_up_front_checks(job):
    from megatron_rl_patches.integrations import check_settings
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
    from megatron_rl_patches.integrations.megatron.opd.rollout_teachers import rollout_entries

    variables, argv = job
    assert set(variables) == VARIABLES and "--train-env-vars" not in argv
    assert variables["MEGATRON_RL_PATCHES_TEACHER_API_KEY"] == KEY  # the shell's key, not a literal
    check_settings(variables)  # what doctor, `run` and the start-up hook check
    settings = opd_settings(variables)
    assert settings is not None and settings.score_at == "rollout" and settings.ids_from == "teacher"
    (teacher,) = rollout_entries(settings)  # asked by the rollout manager, as each sample's generation ends
    assert len(teacher.path.split("|")) == 2 and teacher.engine == "vllm"
    assert f"--max-logprobs {settings.k}" in recipe_block().text  # the replicas serve K


def test_slimes_flags_pass_slime_opds_own_checks(job):
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
    from megatron_rl_patches.integrations.slime.opd import check_args

    variables, argv = job

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    args = argparse.Namespace(loss_type=flag("--loss-type"), custom_loss_function_path=flag(
        "--custom-loss-function-path"), rollout_temperature=float(flag("--rollout-temperature")),
        hf_checkpoint=flag("--hf-checkpoint"))
    settings = opd_settings(variables)
    check_args(args, settings)  # raises ValueError naming what slime_opd refuses
    with pytest.raises(ValueError, match="served engines score prompt log-probs at temperature 1"):
        check_args(argparse.Namespace(**{**vars(args), "rollout_temperature": 0.7}), settings)


def test_the_variable_table_and_distillation_link_it_and_say_where_each_variable_is_read(capsys):
    from megatron_rl_patches.apps.cli import main

    variables = (REPO / "docs" / "variables.md").read_text(encoding="utf-8")
    distillation = (REPO / "docs" / "distillation.md").read_text(encoding="utf-8")
    assert f"]({LINK})" in variables and LINK in distillation
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    help_text = " ".join(out.split()).replace("- ", "-")  # textwrap breaks lines after a hyphen
    row = next(line for line in variables.splitlines() if line.startswith("| `MEGATRON_RL_PATCHES_OPD_TEACHERS`"))
    for text in (help_text, row, " ".join(distillation.split())):
        assert re.search(r"rollout manager[^.]*runtime_env", text), text[:300]
        assert "--train-env-vars reaches the training actors only" in text.replace("`", ""), text[:300]
    assert "set in the training actors' environment (--train-env-vars)" not in help_text
