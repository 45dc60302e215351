"""What every command shares: the program name, the exit codes, the one-line error, the help format."""
from __future__ import annotations

import argparse
import sys

PROG = "megatron-rl-patches"

# Every command: 0 ok, 1 a problem found (or a step failed), 2 usage error.
OK, PROBLEM, USAGE = 0, 1, 2


class UsageError(Exception):
    """Raised by a command's `run` for bad arguments: one stderr line, exit code 2."""


def say(command: str, message: str) -> None:
    """One stderr line naming the program and the command."""
    print(f"{PROG} {command}: {message}", file=sys.stderr)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default (unless it is None or False) and keeps the epilog's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or any(action.default is hidden for hidden in (None, False, argparse.SUPPRESS)):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text
