"""Issue 29 (defects 6-8 and the new user's trips): a seed out of range is a usage error, `run
--patches` names the option at fault, --help describes every variable (the backend's meaning, the
default roles), `doctor` shows patch lists by whole names and fails on an unknown one."""
from __future__ import annotations

import json

import pytest

from megatron_rl_patches.apps import cli
from megatron_rl_patches.apps.cli import doctor
from megatron_rl_patches.integrations import default_registry
from megatron_rl_patches.integrations.slime_roles import DEFAULT_INFERENCE_ROLES
from megatron_rl_patches.patching import env


@pytest.mark.parametrize("seed", ["18446744073709551616", "-1", str(2**32)])
def test_a_seed_out_of_range_is_a_one_line_usage_error(cli_run, seed):
    code, out, err = cli_run("demo", "--seed", seed, "--route", "plain", "--rollouts", "1", "--steps", "1")
    assert code == cli.USAGE and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("megatron-rl-patches demo: ") and "--seed" in line and "2**32" in line


def test_run_with_a_bad_patches_option_names_the_option_not_the_variable(cli_run, monkeypatch):
    monkeypatch.delenv(env.SELECT, raising=False)
    code, out, err = cli_run("run", "--patches", "bogus", "--", "true")
    assert code == cli.USAGE and out == ""
    (line,) = err.strip().splitlines()
    assert "unknown patch name(s) 'bogus' in --patches" in line and env.SELECT + ";" not in line


def _variable_help(text: str) -> dict[str, str]:
    """The epilog's variables -> their description, joined into one line each."""
    described: dict[str, list[str]] = {}
    current = None
    for line in text.split("environment variables:")[1].split("exit codes:")[0].splitlines():
        if line.startswith("  ") and not line.startswith("    "):
            current = line.strip()
            described[current] = []
        elif current and line.strip():
            described[current].append(line.strip())
    return {name: " ".join(words) for name, words in described.items()}


def test_help_describes_every_variable_the_backend_and_the_default_roles(cli_run):
    code, out, _ = cli_run("--help")
    assert code == 0
    described = _variable_help(out)
    assert set(described) == set(env.VARIABLES)
    assert all(described.values()), [name for name, text in described.items() if not text]
    backend = described[env.BACKEND]
    assert all(word in backend for word in ("torch", "triton", "auto", "backend="))
    roles = described[env.INFERENCE_ROLES]
    assert all(role in roles for role in DEFAULT_INFERENCE_ROLES), roles


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
