"""MEGATRON_RL_PATCHES set where start-up patching did not run (an editable install has no start-up
file) is no silent no-op: the package's first import, applied() and doctor say so once, naming both
fixes (the launcher and `startup install`); where the hook ran (the launcher) nothing is said."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_rl_patches.patching.startup import files as startup

NOTICE = "start-up patching did not run"
FIXES = ("megatron-rl-patches run -- ", "megatron-rl-patches startup install")
CHILD = ("import megatron_rl_patches as m, json, sys; s = m.applied(); m.applied(); "
         "print(json.dumps([sys.modules['megatron_rl_patches.patching.startup.hook'].has_run(), "
         "sorted({x.code for x in s})]))")


def child(code: str, *, launcher: bool = False, **variables: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_RL_PATCHES", "RANK"))}
    environ.update(variables)
    prefix = [sys.executable, "-m", "megatron_rl_patches", "run", "--"] if launcher else []
    return subprocess.run([*prefix, sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(autouse=True)
def no_startup_file():
    installed = [f.path for d in startup.site_dirs() for f in startup.inspect_dir(d) if f.present]
    assert not installed, "these checks need an install without the .pth start-up file (e.g. editable)"


@pytest.mark.parametrize("value", ["all", "bogus", "ddp_hooks"])
def test_import_and_applied_say_once_that_the_variable_did_nothing(value):
    proc = child(CHILD, MEGATRON_RL_PATCHES=value)
    assert proc.returncode == 0, proc.stderr
    ran, codes = json.loads(proc.stdout)
    assert ran is False and codes == ["not_selected"]  # the no-op the notice is about
    (line,) = proc.stderr.splitlines()
    assert NOTICE in line and f"MEGATRON_RL_PATCHES={value!r}" in line
    assert all(fix in line for fix in FIXES), line


def test_applied_says_it_when_the_import_was_silent():
    proc = child("import megatron_rl_patches.patching.env; import megatron_rl_patches as m; m.applied()",
                 MEGATRON_RL_PATCHES="all")
    assert proc.returncode == 0 and NOTICE in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("variables", [{}, {"MEGATRON_RL_PATCHES": "0"}, {"MEGATRON_RL_PATCHES": "all", "RANK": "3"}])
def test_nothing_said_when_off_or_on_another_rank(variables):
    proc = child(CHILD, **variables)
    assert proc.returncode == 0 and proc.stderr == ""


def test_nothing_said_where_the_launcher_ran_the_hook():
    proc = child(CHILD, launcher=True, MEGATRON_RL_PATCHES="ddp_hooks")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])[0] is True and NOTICE not in proc.stderr


def test_doctor_names_both_fixes():
    proc = child("from megatron_rl_patches.apps.cli import main; raise SystemExit(main(['doctor', '--json']))",
                 MEGATRON_RL_PATCHES="all")
    problems = "\n".join(json.loads(proc.stdout)["problems"])
    assert proc.returncode == 1 and all(fix in problems for fix in FIXES), problems
    assert proc.stderr.count(NOTICE) <= 1
