"""One protocol and one set of exit codes for every command (0 ok, 1 a problem, 2 usage error), help
texts with defaults and the environment variables, display words, and quiet broken pipes."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl_patches.apps import cli
from megatron_rl_patches.apps.cli.targets import shown_status
from megatron_rl_patches.patching import env, records

PATCH_NAMES = {"ddp_hooks", "train_reentry", "inference_roles", "slime_logprobs", "gpt_output_processor",
              "grad_windows", "verl_fused_logprobs", "verl_topk_kd"}




def test_every_command_is_a_module_of_the_cli_package():
    for name, (module_name, help_text) in cli.COMMANDS.items():
        assert module_name.startswith("megatron_rl_patches.apps.cli.") and help_text
        module = importlib.import_module(module_name)
        assert callable(module.add_arguments) and callable(module.run), name
    package = Path(importlib.import_module("megatron_rl_patches").__file__).parent
    for old in ("cli.py", "memory_cli.py", "bench/cli.py"):  # the commands' old homes are gone
        assert not (package / old).exists(), old
    assert not hasattr(importlib.import_module("megatron_rl_patches.apps.demo"), "run")


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_an_unknown_option_is_a_usage_error_for_every_command(cli_run, command):
    code, out, err = cli_run(command, "--no-such-option")
    assert code == cli.USAGE == 2 and out == "" and "error:" in err


@pytest.mark.parametrize(
    "argv, variables, words",
    [
        (["list", "--apply"], {env.SELECT: "bogus"}, "'bogus'"),
        (["list", "--apply"], {env.SELECT: "all", env.STRICT: "maybe"}, "1/true/yes/on"),
        (["startup", "install", "--site", "/no/such/site-packages"], {}, "does not exist"),
        (["memory", "--params", "7B", "--param-dtype", "fp32", "--grad-dtype", "bf16"], {}, "grad buffer is fp32"),
        (["demo", "--rollouts", "0"], {}, "--rollouts >= 1"),
        (["bench", "--quick", "--out", "/dev/null"], {}, "not a folder"),
        (["bench", "--quick", "--out", "/proc/nope"], {}, "cannot write there"),
    ],
)
def test_usage_errors_found_by_a_command_are_one_line_and_exit_2(cli_run, clean, argv, variables, words):
    for name, value in variables.items():
        clean.setenv(name, value)
    code, out, err = cli_run(*argv)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"megatron-rl-patches {argv[0]}: ") and words in line


def test_help_names_every_environment_variable_and_the_exit_codes(cli_run):
    code, out, _ = cli_run("--help")
    assert code == 0 and "exit codes: 0 ok, 1 a problem found, 2 usage error" in out
    assert all(name in out for name in env.VARIABLES)
    for command in cli.READS_ENVIRONMENT:
        code, out, _ = cli_run(command, "--help")
        assert code == 0 and all(name in out for name in env.VARIABLES), command


def test_help_shows_defaults(cli_run):
    pages = {command: " ".join(cli_run(command, "--help")[1].split()) for command in ("memory", "bench", "demo")}
    assert "data-parallel size (default: 1)" in pages["memory"]
    assert "weights (default: bf16)" in pages["memory"] and "dtype (default: fp32)" in pages["memory"]
    assert "which benchmark" in pages["bench"] and "none of the four in `all`) (default: all)" in pages["bench"]
    assert "train() calls (>= 1) (default: 4)" in pages["demo"]
    assert "seed of the models and the data (default: 0)" in pages["demo"]
    assert not any("(default: None)" in page or "(default: False)" in page for page in pages.values())


@pytest.mark.parametrize("argv", [["doctor", "--json"], ["list"]])
def test_a_closed_pipe_ends_the_command_quietly(argv):
    """`megatron-rl-patches doctor --json | head -1`: the reader leaves early, no traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: every write fails with EPIPE
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    try:
        proc = subprocess.run([sys.executable, "-m", "megatron_rl_patches", *argv], stdout=write,
                              stderr=subprocess.PIPE, env=environ, timeout=120)
    finally:
        os.close(write)
    assert proc.stderr.decode() == ""
    assert proc.returncode == cli.BROKEN_PIPE == 141


def test_list_shows_off_for_patches_not_selected(cli_run):
    code, out, _ = cli_run("list")
    words = {line.split()[1] for line in out.splitlines() if line.split() and line.split()[0] in PATCH_NAMES}
    assert code == 0 and words == {"off"} and "skipped" not in out
    code, out, _ = cli_run("list", "--json")  # JSON keeps the statuses and their reason codes
    assert {(row["status"], row["code"]) for row in json.loads(out)} == {("skipped", "not_selected")}


@pytest.mark.parametrize(
    "status, code, word",
    [
        ("skipped", records.NOT_SELECTED, "off"), ("skipped", records.DISABLED, "off"),
        ("skipped", records.REVERTED, "reverted"), ("skipped", records.NATIVE, "native"),
        ("skipped", records.OPTIONAL_MISSING, "n/a"), ("skipped", records.VERSION, "skipped"),
        ("skipped", records.SIGNATURE, "skipped"), ("skipped", records.MISSING, "skipped"),
        ("failed", records.ERROR, "failed"), ("applied", records.OK, "applied"),
        ("applied", records.UNTESTED, "applied"), ("pending", records.WAITING, "pending"),
    ],
)
def test_display_words_keep_skipped_for_problems(status, code, word):
    assert shown_status(records.PatchStatus("p", "m:f", status, "why", code)) == word


@pytest.mark.megatron
def test_list_shows_native_where_megatron_core_has_the_feature(cli_run, clean):
    import megatron.core.models.gpt.gpt_model  # noqa: F401 - the target module is imported

    from megatron_rl_patches.integrations.megatron import version as megatron_version

    clean.setattr(megatron_version, "installed_version", lambda: "0.19.2")  # provides output_processor
    clean.setenv(env.SELECT, "gpt_output_processor")
    code, out, _ = cli_run("list", "--apply")
    line = next(line for line in out.splitlines() if line.startswith("gpt_output_processor"))
    assert code == 0 and line.split()[1] == "native"
    code, out, _ = cli_run("list", "--json")
    (row,) = [row for row in json.loads(out) if row["name"] == "gpt_output_processor"]
    assert (row["status"], row["code"]) == ("skipped", "native")
