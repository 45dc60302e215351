"""`megatron-rl-patches run [--patches NAMES] -- COMMAND ...`: run a command so that every Python
process it starts (torchrun workers, Ray actors launched with this environment, plain `python`)
applies the patches at start-up, in any install and without writing a file anywhere.

The child environment gets the selection (MEGATRON_RL_PATCHES) and the launcher's start-up folder
first on PYTHONPATH (its `sitecustomize` runs the bootstrap and then chains to the
`sitecustomize` it shadows). The command then replaces this process (exec), as ddtrace-run and
opentelemetry-instrument do: signals and exit codes are the command's own.
"""
from __future__ import annotations

import errno
import os
import shutil
import sys
from collections.abc import Mapping, Sequence

from megatron_rl_patches.patching import check_settings, env, load_registry

LAUNCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")  # holds only sitecustomize
# the folder holding the megatron_rl_patches package (four levels up from this file)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ROOT_VARIABLE = env.LAUNCHER_ROOT


def launch_environment(patches: str | None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `environ` (default: this one) as given, plus the selection and the
    start-up folder. `patches`: "all", comma-separated names, or None to keep the environment's
    MEGATRON_RL_PATCHES ("all" when it is unset or empty). Every variable of ours is checked
    first (see :func:`env.check`): ValueError naming the one at fault, nothing started."""
    child = dict(os.environ if environ is None else environ)
    if patches is not None:
        if not isinstance(patches, str) or not env.split_names(patches):
            raise ValueError(f"--patches names no patch: pass 'all' or comma-separated patch names, got {patches!r}")
        names = env.selected_names({env.SELECT: patches})  # None: "all" (or another word for every patch)
        if names is not None:
            env.check_names("--patches", names, load_registry().patch_names())
        child[env.SELECT] = patches.strip()
    elif env.is_off(child):
        raise ValueError(f"{env.SELECT}={child[env.SELECT]!r} disables patching; unset it or pass --patches")
    elif not env.is_enabled(child):
        child[env.SELECT] = "all"
    env.check(load_registry().patch_names(), child)
    check_settings(child)
    child["PYTHONPATH"] = _with_launch_dir(child.get("PYTHONPATH", ""))
    child[ROOT_VARIABLE] = PACKAGE_ROOT
    return child


def _with_launch_dir(pythonpath: str) -> str:
    """LAUNCH_DIR first, then `pythonpath` entry for entry: an empty entry means the current
    directory to Python, so none is dropped, and none is added when there was nothing."""
    launch = os.path.realpath(LAUNCH_DIR)
    rest = [p for p in pythonpath.split(os.pathsep) if not (p and os.path.realpath(p) == launch)] if pythonpath else []
    return os.pathsep.join([LAUNCH_DIR, *rest])


def _program(name: str, search_path: str | None) -> str | None:
    """Where a shell would run `name` from: itself when it holds a '/', else the first executable
    on `search_path`, else the first plain file there (which then fails with 'Permission denied')."""
    if os.sep in name or (os.altsep and os.altsep in name):
        return name
    found = shutil.which(name, path=search_path)
    if found is not None:
        return found
    for folder in (search_path or os.defpath).split(os.pathsep):
        candidate = os.path.join(folder or os.curdir, name)
        if os.path.isfile(candidate):
            return candidate
    return None


def _exec_failure(program: str, error: OSError) -> tuple[int, str]:
    """The shell's exit code and message when `program` could not be executed."""
    if error.errno == errno.ENOENT:
        if os.path.exists(program):  # the file is there: its #! interpreter is not
            return 126, "bad interpreter: No such file or directory"
        return 127, "No such file or directory"
    return 126, error.strerror or str(error)  # EACCES, ENOEXEC (Exec format error), ...


def run(command: Sequence[str], patches: str | None = None) -> int:
    """Exec `command` with the launch environment; returns only when it cannot be started, with
    the shell's code: 127 not found, 126 found but not executable (one stderr line each)."""
    if not command:
        raise ValueError("no command given: megatron-rl-patches run [--patches all|NAMES] -- COMMAND [ARGS...]")
    child = launch_environment(patches)
    program = _program(command[0], child.get("PATH"))
    if program is None:
        code, message = 127, "command not found"
    elif os.path.isdir(program):
        code, message = 126, "Is a directory"
    else:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execve(program, list(command), child)
        except OSError as exc:
            code, message = _exec_failure(program, exc)
    sys.stderr.write(f"megatron-rl-patches run: {command[0]}: {message}\n")
    return code
