"""`memory --hf` given the config file docs/recipes.md names (tests/apps/cli/hf_configs/Qwen3.5-27B.json;
issue 63 item 9: it was refused, suggesting its parent directory, which holds no config.json): planned
as its directory's config.json, the same plan as from a directory holding it, naming the file; the
builder keeps refusing a file (it reads the weights beside it)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "hf_configs" / "Qwen3.5-27B.json"


@pytest.mark.parametrize("extra", [("--residency", "stream"), ("--teacher-tp", "8", "--dp", "8"), ("--json",)])
def test_the_recipes_config_file_plans_as_its_directory(cli_run, tmp_path, extra):
    shutil.copy(FIXTURE, tmp_path / "config.json")
    code, from_file, err = cli_run("memory", "--hf", str(FIXTURE), *extra)
    assert code == 0, err
    code, from_directory, _ = cli_run("memory", "--hf", str(tmp_path), *extra)
    assert from_file == from_directory.replace(str(tmp_path), str(FIXTURE))
    assert str(FIXTURE) in from_file and "Qwen3.5" not in str(tmp_path)


def test_a_refusal_names_the_file(cli_run):
    code, _, err = cli_run("memory", "--hf", str(FIXTURE), "--teacher-tp", "6", "--dp", "12")
    assert code == 2 and f"{FIXTURE}: num_key_value_heads=4 is not a multiple of the tensor-parallel size 6" in err


def test_the_builder_still_refuses_a_config_file():
    from megatron_rl_patches.inference.loading.hf.checkpoint_config import checkpoint_dir

    with pytest.raises(ValueError, match="is a file; pass the checkpoint directory"):
        checkpoint_dir(FIXTURE)
