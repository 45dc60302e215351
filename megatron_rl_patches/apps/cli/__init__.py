"""`megatron-rl-patches` (also `python -m megatron_rl_patches`): one module per command.

Every command module provides `add_arguments(parser)` and `run(args) -> int`; `run` may raise
:class:`UsageError` for a one-line usage error. Only the module of the command being run is
imported, so `--help` and the light commands stay cheap. Exit codes, for every command: 0 ok,
1 a problem found, 2 usage error (also: a command this installation does not have).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from megatron_rl_patches import __version__
from megatron_rl_patches._backend_env import MEANING as BACKEND_MEANING
from megatron_rl_patches.apps.cli._common import OK, PROBLEM, PROG, USAGE, HelpFormatter, UsageError, say
from megatron_rl_patches.patching import env

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
    "run": ("megatron_rl_patches.apps.cli.run",
            "run a command whose Python processes all apply the patches at start-up"),
}

# Commands whose --help ends with the environment variables (they read them).
READS_ENVIRONMENT = ("list", "doctor", "startup", "run")

# Exit status when the reader of stdout went away (`... | head`): the shells' 128 + SIGPIPE.
BROKEN_PIPE = 141


def environment_help() -> str:
    """The environment variables the patches read, one per line (the epilog of --help)."""
    meaning = {
        env.SELECT: '"all" (or "1") or comma-separated patch names: applied in every Python process '
                    'at start-up; unset, "" or "0": off',
        env.DISABLE: "comma-separated patch names removed from any selection",
        env.STRICT: '1/true/yes/on: patch problems raise instead of warning (0/false/no/off/"": warn)',
        # the roles are integrations.slime.roles.DEFAULT_INFERENCE_ROLES (a test holds them equal; not
        # imported here: --help of every command, the plain demo's included, imports no integration)
        env.INFERENCE_ROLES: "comma-separated roles built inference-only, each once (unset: slime's teacher "
                             'roles prm_teacher,teacher; "": none); role:mode keeps its weights off the device, '
                             "mode resident, swap or stream (e.g. teacher:swap,prm_teacher:stream)",
        env.ALLOW_UNTESTED: "1: apply patches outside their supported megatron-core range "
                            "(one warning each)",
        env.BACKEND: BACKEND_MEANING,
    }
    meaning.update(PATCH_VARIABLES)
    lines = ["environment variables:"]
    for name in (*env.VARIABLES, *PATCH_VARIABLES):
        lines.append(f"  {name}")
        lines.append(textwrap.fill(meaning.get(name, ""), 78, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


# Variables one patch reads when it runs (names kept here as text: --help imports no integration;
# a test holds them equal to the integrations' own names).
_OPD = "MEGATRON_RL_PATCHES_OPD_"
PATCH_VARIABLES = {
    f"{_OPD}TEACHERS": "slime_opd: comma-separated teachers, PATH (a checkpoint of the actor's architecture, "
                       "or a Hugging Face directory of another served family: built by "
                       "build_inference_model_from_hf) or PATH@module:function; a Hugging Face directory with "
                       "another tokenizer than the student's: PATH;tokenizer=own (quote the ';'), optionally "
                       "followed by ;stop_tokens=module:function (a student special id -> the teacher's id or "
                       "None); set in the training actors' environment (--train-env-vars)",
    f"{_OPD}WEIGHTS": "slime_opd: mixture weights, one per teacher, summing to 1 (unset: uniform)",
    f"{_OPD}K": "slime_opd: the student's top-k ids per token (default 16)",
    f"{_OPD}DIVERGENCE": "slime_opd: reverse_kl (default), forward_kl, jsd, skew_forward_kl, skew_reverse_kl, "
                         "tv or mixed_kl",
    f"{_OPD}COEF": "slime_opd: weight of the top-k divergence (default 1.0)",
    f"{_OPD}POLICY_WEIGHT": "slime_opd: weight of slime's policy loss (default 1.0)",
    f"{_OPD}RESIDENCY": "slime_opd: resident (default), swap or stream, for the separate teachers "
                        "(PATH@module:function, Hugging Face folders of another architecture)",
    f"{_OPD}IDS_FROM": "slime_opd: student (default) or union (the student's and the first teacher's top-k)",
    "MEGATRON_RL_PATCHES_VERL_ROWS": "verl_fused_logprobs: all computes every row, not only the rows verl reads",
}


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
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (argparse printed why)
        return exc.code if isinstance(exc.code, int) else USAGE
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
