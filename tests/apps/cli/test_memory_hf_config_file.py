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


@pytest.mark.parametrize("extra", [("--json",), ("--teacher-tp", "8", "--dp", "8")])
def test_a_checkpoints_own_config_json_is_refused_naming_its_directory(cli_run, tmp_path, extra):
    """Issue 72 item 7 (round 7's one rule, CHANGELOG issue 55 item 5): a file named config.json sits in
    its checkpoint directory, so that directory is what to pass, as every other entry point says; only
    a config saved under another name (the recipes' fixture above) is planned as a file."""
    shutil.copy(FIXTURE, tmp_path / "config.json")
    given = tmp_path / "config.json"
    before = given.read_bytes()
    code, out, err = cli_run("memory", "--hf", str(given), *extra)
    assert (code, out) == (2, "")
    assert f"--hf {str(given)!r} is a file; pass the checkpoint directory that holds it as config.json " \
           f"({str(tmp_path)!r} if it is that)" in err, err
    assert given.read_bytes() == before
    assert cli_run("memory", "--hf", str(tmp_path), *extra)[0] == 0  # what it says to pass: planned
