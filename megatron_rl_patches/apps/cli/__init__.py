"""`megatron-rl-patches` (also `python -m megatron_rl_patches`): one module per command.

Every command module provides `add_arguments(parser)` and `run(args) -> int`; `run` may raise
:class:`UsageError` for a one-line usage error. Only the module of the command being run is
imported, so `--help` and the light commands stay cheap. Exit codes, for every command: 0 ok,
1 a problem found, 2 usage error (also: a command this installation does not have). A module that
sets `PASSES_THROUGH = True` gets the words after the first '--' unparsed, as `args.passed_through`;
one that sets `SECRET_OPTIONS` (e.g. `("--api-key",)`) has their values shown as '…' in every usage
error argparse writes, whatever spelling carried them (`_common.names_option`).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from megatron_rl_patches import __version__
from megatron_rl_patches.apps.cli._common import (
    OK,
    PROBLEM,
    PROG,
    USAGE,
    HelpFormatter,
    UsageError,
    say,
    secret_values,
    without_values,
)
from megatron_rl_patches.settings import MEANINGS

__all__ = ["COMMANDS", "OK", "PROBLEM", "PROG", "USAGE", "UsageError", "build_parser", "main"]

# command -> (module providing add_arguments / run, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "list": ("megatron_rl_patches.apps.cli.listing", "patches, their targets, version ranges and statuses"),
    "doctor": ("megatron_rl_patches.apps.cli.doctor",
               "megatron-core in use, per-patch support, environment, start-up files"),
    "startup": ("megatron_rl_patches.apps.cli.startup", "install or remove the start-up file (editable installs)"),
    "demo": ("megatron_rl_patches.apps.cli.demo", "a tiny real megatron-core RL loop, with and without the patches"),
    "bench": ("megatron_rl_patches.apps.cli.bench",
              "benchmarks: log-prob and top-k losses (memory, time), re-entrant wrapper cost; "
              "gpu: every implementation on CUDA"),
    "memory": ("megatron_rl_patches.apps.cli.memory", "training-state bytes an inference-only build saves"),
    "serve-teacher": ("megatron_rl_patches.apps.cli.serve_teacher",
                      "a teacher server on vLLM's engine that computes a group's shared prompt once"),
    "shared-prefix": ("megatron_rl_patches.apps.cli.shared_prefix",
                      "check: what each framework's passes do with a group's prompt, from a model's config and a "
                      "layout"),
    "run": ("megatron_rl_patches.apps.cli.run",
            "run a command whose Python processes all apply the patches at start-up"),
}

# Commands whose --help ends with the environment variables (they read them).
READS_ENVIRONMENT = ("list", "doctor", "startup", "run")

# Exit status when the reader of stdout went away (`... | head`): the shells' 128 + SIGPIPE.
BROKEN_PIPE = 141


def environment_help() -> str:
    """The environment variables the package reads, one per line (the epilog of --help): the one table."""
    lines = ["environment variables:"]
    for name, meaning in MEANINGS.items():
        lines.append(f"  {name}")
        lines.append(textwrap.fill(meaning, 78, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


class CommandUnavailable(Exception):
    """The module of a command is not part of this installation."""


def _load(command: str) -> Any:
    """Import the module that implements `command` (see COMMANDS)."""
    module_name = COMMANDS[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise CommandUnavailable(
                f"not available in this installation (module {module_name} is missing): a partial "
                f"installation; reinstall megatron-rl-patches"
            ) from exc
        raise
    if not (callable(getattr(module, "add_arguments", None)) and callable(getattr(module, "run", None))):
        raise TypeError(f"{module_name} must provide add_arguments(parser) and run(args) -> int")
    return module


def _selected_command(argv: Sequence[str]) -> str | None:
    """The command argv names (the first positional word; no top-level option takes a value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(command: str | None = None) -> tuple[argparse.ArgumentParser, Any]:
    """The argument parser, with the arguments of `command` only (whose module is imported)."""
    epilog = environment_help()
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Monkeypatches, wrappers and memory-optimal losses for Megatron-core RL post-training.",
        epilog=f"{epilog}\n\nexit codes: 0 ok, 1 a problem found, 2 usage error",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    implementation = None
    for name, (_, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter,
                                    epilog=epilog if name in READS_ENVIRONMENT else None)
        if name == command:
            implementation = _load(name)
            implementation.add_arguments(sub_parser)
    return parser, implementation


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the reader left, and the final flush must not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # stdout is not a real file (tests capture it)
        pass


def parsed(parser: argparse.ArgumentParser, argv: list[str], secrets: Sequence[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`; with `secrets` (a command's secret options) what argparse writes to
    stderr (a usage error quoting the words it did not take) is written with their values as '…'."""
    if not secrets:
        return parser.parse_args(argv)
    written = io.StringIO()
    try:
        with contextlib.redirect_stderr(written):
            return parser.parse_args(argv)
    finally:
        sys.stderr.write(without_values(written.getvalue(), secret_values(argv, secrets)))


def _run(argv: list[str]) -> int:
    command = _selected_command(argv)
    try:
        parser, implementation = build_parser(command if command in COMMANDS else None)
    except CommandUnavailable as exc:
        say(str(command), str(exc))
        return USAGE
    except ModuleNotFoundError as exc:
        say(str(command), f"needs the module {exc.name!r}, which is not installed")
        return PROBLEM
    passed: list[str] = []
    if getattr(implementation, "PASSES_THROUGH", False) and "--" in argv:  # e.g. another program's arguments
        argv, passed = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    try:
        args = parsed(parser, argv, getattr(implementation, "SECRET_OPTIONS", ()))
    except SystemExit as exc:  # --help, --version, or a usage error (argparse printed why)
        return exc.code if isinstance(exc.code, int) else USAGE
    args.passed_through = passed
    if implementation is None:
        parser.print_help(sys.stderr)
        return USAGE
    try:
        return int(implementation.run(args) or OK)
    except UsageError as exc:
        say(args.command, str(exc))
        return USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    try:
        code = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `... | head`: the reader has what it wanted
        _quiet_stdout()
        return BROKEN_PIPE
    except KeyboardInterrupt:
        return 130
