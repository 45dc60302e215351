"""The docs' `$ ` commands run as a reader pastes them (issue 110 item 10): in bash, in a fresh shell at
a folder that stands for the clone's root, where no environment is on PATH and none is activated.

The pages write a command of the clone with the clone's environment, `.venv/bin/python ...` or
`.venv/bin/megatron-rl-patches ...` (README.md, "Commands on these pages"). In the folder the runner
builds, `.venv` is the environment running the tests (the main lane's `.venv`, the newest lane's
`.venv-mcore019`) and every other entry is the repository's own, linked; PATH loses every
environment's `bin` and VIRTUAL_ENV is unset. So a bare `python examples/...` finds an interpreter
without torch (or none), and a bare `megatron-rl-patches` is no command: the test fails on it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from doc_blocks import REPO

TIMEOUT = 600
VENV = ".venv"
# what a reader's shell does not carry: the package's own variables, an activated environment
DROPPED = ("VIRTUAL_ENV", "PYTHONHOME", "CONDA_PREFIX")
ENV_BIN = re.compile(r"/\.?venv[^/]*/bin/?$")


def environment_bins() -> set[str]:
    """The `bin` folders of the environment running the tests (resolved)."""
    return {os.path.realpath(os.path.join(sys.prefix, "bin")), os.path.realpath(os.path.dirname(sys.executable))}


def reader_environ(environ: dict[str, str] | None = None) -> dict[str, str]:
    """`environ` (default: this process's) as a fresh shell has it: no MEGATRON_RL_PATCHES* variable,
    no activated environment, and no environment's `bin` on PATH."""
    environ = dict(os.environ if environ is None else environ)
    bins = environment_bins()
    active = environ.get("VIRTUAL_ENV")
    if active:
        bins.add(os.path.realpath(os.path.join(active, "bin")))
    path = [entry for entry in environ.get("PATH", "").split(os.pathsep)
            if entry and os.path.realpath(entry) not in bins and not ENV_BIN.search(entry)]
    reader = {k: v for k, v in environ.items() if not k.startswith("MEGATRON_RL_PATCH") and k not in DROPPED}
    reader["PATH"] = os.pathsep.join(path)
    return reader


def clone_root(folder: Path) -> Path:
    """`folder` made to stand for the clone's root: the repository's entries linked, `.venv` the
    environment running the tests."""
    folder.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if entry.name != VENV and not (folder / entry.name).exists():
            (folder / entry.name).symlink_to(entry)
    if not (folder / VENV).exists():
        (folder / VENV).symlink_to(sys.prefix)
    return folder


@dataclass
class Pasted:
    """One command started in bash, as pasted."""
    where: str
    command: str
    proc: subprocess.Popen

    def stop(self) -> None:
        """Kill it if it still runs (a test that failed before reading it)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()

    def finish(self) -> str:
        """What it printed on stdout; a failure (an exit, a Python warning on stderr, which no page
        shows) names the page's line."""
        try:
            stdout, stderr = self.proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise AssertionError(f"{self.where}: `{self.command}` still running after {TIMEOUT} s") from None
        assert self.proc.returncode == 0, (
            f"{self.where}: `{self.command}` fails as pasted in a fresh shell at the clone's root, no environment "
            f"on PATH (exit {self.proc.returncode}):\n{stderr[-3000:]}")
        assert "Warning" not in stderr, (
            f"{self.where}: `{self.command}` warns, which the page does not show:\n{stderr[-2000:]}")
        return stdout


def paste(where: str, command: str, root: Path) -> Pasted:
    """Start `command` in bash at `root` in a reader's environment."""
    proc = subprocess.Popen(["bash", "-c", command], cwd=root, env=reader_environ(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Pasted(where, command, proc)
