"""`megatron-rl-patches run [--patches all|NAMES] -- COMMAND [ARGS...]`: run COMMAND so that every
Python process it starts applies the patches at start-up, in any kind of install.

The command replaces this process (exec): its exit code, signals and output are its own. Every
MEGATRON_RL_PATCHES* variable is checked before anything starts (a bad one: exit 2); a command
that cannot be started exits as in a shell: 127 not found, 126 found but not executable.
"""
from __future__ import annotations

import argparse

from megatron_rl_patches.apps.cli._common import UsageError
from megatron_rl_patches.patching.startup import launcher


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--patches",
        metavar="all|NAMES",
        default=None,
        help="patches to apply in the children: 'all' or comma-separated names "
             "(default: $MEGATRON_RL_PATCHES when it is 'all' or names patches, all when it is unset "
             "or empty; an off value such as 0 is refused)",
    )
    parser.add_argument(
        "child_command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND [ARGS...]",
        help="the command to run, after '--' (e.g. -- torchrun --nproc-per-node 8 train.py)",
    )


def run(args: argparse.Namespace) -> int:
    command = list(args.child_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("no command given: megatron-rl-patches run [--patches all|NAMES] -- COMMAND [ARGS...]")
    try:
        return launcher.run(command, args.patches)
    except ValueError as exc:  # a list naming no or unknown patches, a bad MEGATRON_RL_PATCHES* value
        raise UsageError(str(exc)) from None
