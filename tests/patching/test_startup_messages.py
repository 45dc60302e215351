"""The start-up line: never raises whatever stderr is (closed, full), stays one bounded line, and a
bad setting (a yes/no value, a backend, a misspelled variable name) is one line and the patches
still apply; a bad selection applies nothing. Start-up is run as Python runs it: `site.addsitedir` on a folder
holding our .pth file, in a fresh interpreter started with -S."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest

from megatron_rl_patches.patching.startup import files as startup

# After our .pth ran: the user's program (prints "ran") and the default registry's statuses.
PROGRAM = (
    "import site, sys, json; site.addsitedir({purelib!r}); site.addsitedir({ours!r}); print('ran'); "
    "reg = sys.modules.get('megatron_rl_patches.integrations'); "
    "print(json.dumps(sorted({{s.status for s in reg.default_registry().applied()}}) if reg else None))"
)


@pytest.fixture
def startup_dir(tmp_path):
    startup.install(str(tmp_path))
    return tmp_path


def start(startup_dir, shell_redirect: str = "", **variables: str) -> subprocess.CompletedProcess:
    """A fresh interpreter whose start-up runs our .pth, with `variables` and `shell_redirect`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_RL_PATCHES", "RANK"))}
    environ.update(variables)
    code = PROGRAM.format(purelib=sysconfig.get_paths()["purelib"], ours=str(startup_dir))
    script = f'exec "$0" -S -c "$1" {shell_redirect}'
    return subprocess.run(["bash", "-c", script, sys.executable, code], env=environ, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("redirect", ["2>&-", "2>/dev/full"])
def test_bad_selection_with_stderr_closed_or_full_still_starts_the_program(startup_dir, redirect):
    """With stderr closed the traceback used to land on stdout; on a full device start-up aborted."""
    proc = start(startup_dir, redirect, MEGATRON_RL_PATCHES="bogus")
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[0] == "ran" and "Traceback" not in proc.stdout


def test_bad_selection_is_one_line(startup_dir):
    proc = start(startup_dir, MEGATRON_RL_PATCHES="bogus")
    assert proc.returncode == 0 and proc.stdout.splitlines()[0] == "ran"
    (line,) = proc.stderr.splitlines()
    assert line.startswith("megatron-rl-patches: no patch applied at start-up") and "'bogus'" in line


@pytest.mark.parametrize("value", ["x" * 100_000, ",".join(["bogus"] * 16_000),
                                   ",".join(f"n{i}" for i in range(20_000))])
def test_a_huge_selection_prints_a_short_line(startup_dir, value):
    proc = start(startup_dir, MEGATRON_RL_PATCHES=value)
    (line,) = proc.stderr.splitlines()
    assert proc.returncode == 0 and len(line) < 600, len(line)
    assert line.count("'bogus'") <= 1


@pytest.mark.parametrize(("variable", "value"), [("MEGATRON_RL_PATCHES_STRICT", "ture"),
                                                 ("MEGATRON_RL_PATCHES_ALLOW_UNTESTED", "maybe")])
def test_unknown_yes_no_value_warns_one_line_and_patches_anyway(startup_dir, variable, value):
    """One policy for a setting's typo at start-up (docs/patching.md): one line, the setting's
    default, the patches applied — STRICT=ture used to switch every patch off."""
    proc = start(startup_dir, MEGATRON_RL_PATCHES="all", **{variable: value})
    assert proc.returncode == 0
    ran, statuses = proc.stdout.splitlines()
    assert ran == "ran" and "pending" in json.loads(statuses)
    (line,) = proc.stderr.splitlines()
    assert f"{variable}={value!r}" in line and "1/true/yes/on" in line and "using the default (off)" in line


@pytest.mark.parametrize(("variable", "suggestion"), [("MEGATRON_RL_PATCHES_DISABLED", "MEGATRON_RL_PATCHES_DISABLE"),
                                                      ("MEGATRON_RL_PATCHES_OPD_TEACHER",
                                                       "MEGATRON_RL_PATCHES_OPD_TEACHERS")])
def test_a_misspelled_variable_name_warns_one_line_and_patches_anyway(startup_dir, variable, suggestion):
    proc = start(startup_dir, MEGATRON_RL_PATCHES="all", **{variable: "x"})
    ran, statuses = proc.stdout.splitlines()
    assert ran == "ran" and "pending" in json.loads(statuses)
    (line,) = proc.stderr.splitlines()
    assert f"unknown variable(s) {variable} (did you mean {suggestion}?)" in line


@pytest.mark.parametrize("variable, value", [("MEGATRON_RL_PATCHES_BACKEND", "cuda"),
                                             ("MEGATRON_RL_PATCHES_INFERENCE_ROLES", "prm-teacher"),
                                             ("MEGATRON_RL_PATCHES_OPD_IDS_FROM", "teachers"),
                                             ("MEGATRON_RL_PATCHES_OPD_SCORE_AT", "rolout")])  # issue 96 item 3
def test_a_bad_backend_or_role_list_warns_one_line_and_patches_anyway(startup_dir, variable, value):
    """What the launcher refuses, a plain start-up reports once and goes on (patches applied)."""
    opd = {"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/t"} if "_OPD_" in variable else {}
    proc = start(startup_dir, MEGATRON_RL_PATCHES="all", **opd, **{variable: value})
    assert proc.returncode == 0
    ran, statuses = proc.stdout.splitlines()
    assert ran == "ran" and "pending" in json.loads(statuses)
    (line,) = proc.stderr.splitlines()
    assert line.startswith("megatron-rl-patches: ") and f"{variable}={value!r}" in line


@pytest.mark.parametrize("variable, good", [("MEGATRON_RL_PATCHES_INVARIANT", "1"),
                                            ("MEGATRON_RL_PATCHES_VERL_ROWS", "all")])
def test_every_documented_variable_starts_quietly_and_its_typo_is_one_line(startup_dir, variable, good):
    """Issue 63 item 1: the documented invariant switch made every process print 'reads none of them'."""
    proc = start(startup_dir, MEGATRON_RL_PATCHES="all", **{variable: good})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines()[0] == "ran"
    proc = start(startup_dir, MEGATRON_RL_PATCHES="all", **{variable: "tru"})
    (line,) = proc.stderr.splitlines()
    assert f"{variable}='tru'" in line and "unknown variable" not in line
