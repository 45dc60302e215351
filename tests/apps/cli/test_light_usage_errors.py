"""Argument errors come before heavy imports: every command parses (and checks) its arguments
without importing torch or megatron, so a typo is refused at once, not after seconds of imports."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

from megatron_rl_patches.apps import cli

HEAVY = ("torch", "megatron", "numpy", "triton")


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}


def test_no_command_imports_torch_or_megatron_to_refuse_its_arguments():
    argvs = [[name, "--no-such-option"] for name in sorted(cli.COMMANDS)]
    argvs += [["demo", "--route", "nonsense"], ["demo", "--rollouts", "0"], ["bench", "nonsense"],
              ["memory", "--params", "many"], ["startup", "sideways"]]
    script = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from megatron_rl_patches.apps.cli import main
        with contextlib.redirect_stderr(io.StringIO()):
            code = main(json.loads(sys.argv[1]))
        print(json.dumps([code, sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[2])))]))
        """
    )
    found = {}
    for argv in argvs:  # one fresh process each: an import made for one command hides none of the next
        proc = subprocess.run([sys.executable, "-c", script, json.dumps(argv), json.dumps(HEAVY)],
                              env=_environ(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[" ".join(argv)] = json.loads(proc.stdout)
    assert {argv: code for argv, (code, _) in found.items() if code != cli.USAGE} == {}
    assert {argv: heavy for argv, (_, heavy) in found.items() if heavy} == {}


def test_a_usage_error_of_the_demo_takes_well_under_two_seconds():
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megatron_rl_patches", "demo", "--route", "nonsense"],
                          env=_environ(), capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - started
    assert proc.returncode == cli.USAGE and "invalid choice: 'nonsense'" in proc.stderr
    assert elapsed < 2.0, f"a usage error took {elapsed:.1f} s"
