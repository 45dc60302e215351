"""`doctor` and patch names: an unknown name fails with the close one suggested; a long patch
list is shown by whole names, shortened."""
from __future__ import annotations

import json

import pytest

from megatron_rl_patches.apps import cli
from megatron_rl_patches.apps.cli import doctor
from megatron_rl_patches.integrations import default_registry
from megatron_rl_patches.patching import env


def test_doctor_fails_on_an_unknown_name_and_suggests_the_close_one(cli_run, monkeypatch):
    monkeypatch.setenv(env.SELECT, "ddp_hook,train_reentry")
    code, out, _ = cli_run("doctor", "--json")
    assert code == cli.PROBLEM
    problems = json.loads(out)["problems"]
    assert any("'ddp_hook'" in p and "did you mean ddp_hooks?" in p for p in problems), problems


def test_doctor_shows_a_long_patch_list_by_whole_names():
    names = default_registry().patch_names()
    value = ",".join(names * 2)
    text = doctor.format_report({**_report(value), "problems": []})
    (line,) = [line for line in text.splitlines() if line.strip().startswith(f"{env.SELECT}=")]
    shown = line.strip().split("=", 1)[1]
    words = shown.split(" (")[0].rstrip(".").rstrip(", ").split(",")
    assert all(word.strip() in names for word in words if word.strip() not in ("", "...")), shown
    assert f"{len(value):,} characters" in shown and len(shown) < len(value) / 1.5


def _report(select: str) -> dict:
    import os

    os.environ[env.SELECT] = select
    try:
        return doctor.collect()
    finally:
        del os.environ[env.SELECT]


@pytest.mark.parametrize("variables, says", [
    ({env.INFERENCE_ROLES: "teacher:strem"}, "has residency 'strem'"),
    ({env.INFERENCE_ROLES: "teacher:"}, "has residency ''"),
    ({env.INFERENCE_ROLES: "tea cher"}, "is not a role name"),
    ({env.INFERENCE_ROLES: "teacher,teacher:swap"}, "more than once"),
    ({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/t", "MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teachers"},
     "MEGATRON_RL_PATCHES_OPD_IDS_FROM='teachers'"),
    ({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/a,/b", "MEGATRON_RL_PATCHES_OPD_WEIGHTS": "1,1"}, "must sum to 1"),
])
def test_doctor_reports_what_run_and_the_patches_refuse(cli_run, monkeypatch, variables, says):
    """issue 38: doctor --json found no problem in values `run` or slime_opd refuse."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    code, out, _ = cli_run("doctor", "--json")
    report = json.loads(out)
    assert code == cli.PROBLEM and any(says in p for p in report["problems"]), report["problems"]
    if env.INFERENCE_ROLES in variables:
        assert report["environment"]["inference_roles"] == []  # not slime's defaults: the value is wrong
    else:
        assert report["environment"]["opd"] == variables


def test_doctor_shows_each_roles_residency(cli_run, monkeypatch):
    monkeypatch.setenv(env.INFERENCE_ROLES, "prm_teacher:stream,teacher:swap,ref")
    code, out, _ = cli_run("doctor")
    assert "inference roles: prm_teacher:stream, teacher:swap, ref" in out, out


@pytest.mark.parametrize("name, suggestion", [("MEGATRON_RL_PATCH", env.SELECT),
                                              ("MEGATRON_RL_PATCHES_DISABLED", env.DISABLE),
                                              ("MEGATRON_RL_PATCHES_OPD_TEACHER", "MEGATRON_RL_PATCHES_OPD_TEACHERS")])
def test_doctor_names_a_misspelled_variable(cli_run, monkeypatch, name, suggestion):
    """issue 49: ignored, so `run` and the start-up defaulted to every patch without a word."""
    monkeypatch.setenv(name, "all")
    code, out, _ = cli_run("doctor", "--json")
    problems = json.loads(out)["problems"]
    assert code == cli.PROBLEM and any(f"{name} (did you mean {suggestion}?)" in p for p in problems), problems


def test_doctor_checks_the_opd_teachers_paths(cli_run, monkeypatch, tmp_path):
    """issue 49: "no problems found" for a teacher that does not exist or that the builder refuses."""
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

    good, refused, megatron_dir = tmp_path / "good", tmp_path / "gemma", tmp_path / "megatron"
    write_tiny_checkpoint(good, tiny_hf_config("qwen3"))
    refused.mkdir()
    (refused / "config.json").write_text(json.dumps(tiny_hf_config("qwen3", model_type="gemma3")))
    megatron_dir.mkdir()  # a Megatron checkpoint: slime's loader reads it, nothing to check here
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", f"/nonexistent,{good},{refused},{megatron_dir}")
    code, out, _ = cli_run("doctor", "--json")
    problems = [p for p in json.loads(out)["problems"] if p.startswith("MEGATRON_RL_PATCHES_OPD_TEACHERS")]
    assert code == cli.PROBLEM and len(problems) == 2, problems
    assert "teacher '/nonexistent' does not exist" in problems[0]
    assert f"teacher '{refused}': a Hugging Face directory build_inference_model_from_hf refuses" in problems[1]
    assert "model_type 'gemma3'" in problems[1]


def test_doctor_status_column_aligns_for_the_longest_name():
    """issue 49: hybrid_output_processor (23 characters) pushed its status out of the column."""
    report = doctor.collect()
    lines = doctor.format_report(report).splitlines()
    names = {t["name"] for t in report["targets"]}
    rows = [line for line in lines if line[2:].split(" ")[0] in names]
    assert any("hybrid_output_processor" in row for row in rows)
    starts = {len(row) - len(row[2:].split(" ", 1)[1].lstrip()) for row in rows}  # where the status begins
    assert len(starts) == 1, starts


@pytest.mark.parametrize("select", [None, "0", "ddp_hooks"])
def test_doctor_says_slime_opd_is_not_selected_when_only_the_opd_variables_are_set(cli_run, monkeypatch, tmp_path,
                                                                                    select):
    """issue 63 item 9: "no problems found" with MEGATRON_RL_PATCHES_OPD_TEACHERS="DIR;tp=2" and slime_opd
    not selected: the entry did nothing, silently."""
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3"))
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", f"{tmp_path};tp=2")
    if select is not None:
        monkeypatch.setenv("MEGATRON_RL_PATCHES", select)
    code, out, _ = cli_run("doctor", "--json")
    problems = [p for p in json.loads(out)["problems"] if "start-up file" not in p]  # ddp_hooks: none installed
    assert code == cli.PROBLEM and len(problems) == 1, problems
    assert problems[0].startswith("slime_opd is not selected") and "MEGATRON_RL_PATCHES_OPD_TEACHERS" in problems[0]
    monkeypatch.setenv("MEGATRON_RL_PATCHES", "slime_opd")  # the negative control: selected, nothing to say
    code, out, _ = cli_run("doctor", "--json")
    assert not [p for p in json.loads(out)["problems"] if "not selected" in p]
