"""The command line run in-process, as a test of a sub-command calls it."""
from __future__ import annotations

from typing import Any


def run_memory_cli(argv: list[str], capsys: Any) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `megatron-rl-patches memory *argv`, read through pytest's capsys."""
    from megatron_rl_patches.apps.cli import main

    code = main(["memory", *argv])
    out, err = capsys.readouterr()
    return code, out, err
