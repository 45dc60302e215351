"""`megatron-rl-patches run [--patches NAMES] -- COMMAND ...`: run a command so that every Python
process it starts (torchrun workers, Ray actors launched with this environment, plain `python`)
applies the patches at start-up, in any install and without writing a file anywhere.

The child environment gets the selection (MEGATRON_RL_PATCHES) and the launcher's start-up folder
first on PYTHONPATH (its `sitecustomize` runs the bootstrap and then chains to the
`sitecustomize` it shadows). The command then replaces this process (exec), as ddtrace-run and
opentelemetry-instrument do: signals and exit codes are the command's own.
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence

from megatron_rl_patches.patching import env

LAUNCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT_VARIABLE = "MEGATRON_RL_PATCHES_LAUNCHER_ROOT"


def launch_environment(patches: str | None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `environ` (default: this one) plus the selection and the
    start-up folder. `patches`: "all", comma-separated names, or None to keep the environment's
    MEGATRON_RL_PATCHES (or "all" when it is unset). Unknown names raise ValueError."""
    child = dict(os.environ if environ is None else environ)
    if patches is not None:
        if not isinstance(patches, str) or not patches.strip():
            raise ValueError(f"--patches must be 'all' or comma-separated patch names, got {patches!r}")
        child[env.SELECT] = patches.strip()
    elif not env.is_enabled(child):
        child[env.SELECT] = "all"
    names = env.selected_names(child)
    if names is not None:
        from megatron_rl_patches.integrations import default_registry

        env.resolve_selection(default_registry().patch_names(), environ=child)  # raises on unknown names
    paths = [p for p in child.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) != os.path.realpath(LAUNCH_DIR)]
    child["PYTHONPATH"] = os.pathsep.join([LAUNCH_DIR, *paths])
    child[ROOT_VARIABLE] = PACKAGE_ROOT
    return child


def run(command: Sequence[str], patches: str | None = None) -> int:
    """Exec `command` with the launch environment; returns only when it cannot be started (127)."""
    import shutil
    import sys

    if not command:
        raise ValueError("no command given: megatron-rl-patches run [--patches all|NAMES] -- COMMAND [ARGS...]")
    child = launch_environment(patches)
    program = shutil.which(command[0], path=child.get("PATH"))
    if program is None:
        sys.stderr.write(f"megatron-rl-patches run: command not found: {command[0]}\n")
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(program, list(command), child)
    return 127  # not reached
