"""The start-up files (.pth, and .start for Python >= 3.15) that run the hook in every process.

The one source of their text: setup.py writes the wheel's copies from CONTENTS, and editable
installs (PEP 660), which get none from pip, write and remove them with `megatron-rl-patches
startup install|remove`. This module imports only the standard library (setup.py runs it).
"""
from __future__ import annotations

import os
import site
import sysconfig
from dataclasses import dataclass

PTH_NAME = "megatron_rl_patches.pth"
START_NAME = "megatron_rl_patches.start"
# A single `import` line works on every Python; 3.15 prefers the .start entry point form. The
# find_spec guard keeps a start-up file left behind (an editable install uninstalled after
# `startup install`) from printing an ImportError traceback in every process.
CONTENTS = {
    PTH_NAME: (
        'import importlib.util; importlib.util.find_spec("megatron_rl_patches") and '
        '__import__("megatron_rl_patches.patching.startup.hook").patching.startup.hook.run()\n'
    ),
    START_NAME: "megatron_rl_patches.patching.startup.hook:run\n",
}
# What earlier releases wrote (the hook lived in patching.bootstrap, which still forwards to it):
# ours too, so `startup install` replaces them and `startup remove` removes them.
EARLIER_CONTENTS = {
    PTH_NAME: (
        'import importlib.util; importlib.util.find_spec("megatron_rl_patches") and '
        '__import__("megatron_rl_patches.patching.bootstrap").patching.bootstrap.run()\n',
    ),
    START_NAME: ("megatron_rl_patches.patching.bootstrap:run\n",),
}


class ForeignStartupFile(FileExistsError):
    """A file with our start-up file's name but other content: never overwritten or removed."""


@dataclass(frozen=True)
class StartupFile:
    """One start-up file in one site directory: present? ours (this release's or an earlier one's)?
    current (this release's text)?"""

    path: str
    present: bool
    ours: bool
    current: bool = False

    def as_dict(self) -> dict[str, object]:
        return {"path": self.path, "present": self.present, "ours": self.ours, "current": self.current}


def default_site_dir() -> str:
    """This interpreter's site-packages (sysconfig purelib), where pip puts wheels."""
    return sysconfig.get_paths()["purelib"]


def site_dirs() -> list[str]:
    """Every directory whose .pth files this interpreter reads at start-up (that exists)."""
    dirs = [default_site_dir(), *getattr(site, "getsitepackages", list)()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    seen: dict[str, str] = {}
    for path in dirs:
        if os.path.isdir(path):
            seen.setdefault(os.path.realpath(path), path)
    return list(seen.values())


def _text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def inspect_dir(site_dir: str) -> list[StartupFile]:
    """The state of both start-up files in `site_dir`."""
    found = []
    for name in CONTENTS:
        path = os.path.join(site_dir, name)
        present = os.path.lexists(path)
        text = _text(path) if present else None
        current = text == CONTENTS[name].strip()
        ours = current or text in {earlier.strip() for earlier in EARLIER_CONTENTS[name]}
        found.append(StartupFile(path, present, present and ours, present and current))
    return found


def _checked_dir(site_dir: str | None) -> str:
    site_dir = default_site_dir() if site_dir is None else os.fspath(site_dir)
    if not os.path.isdir(site_dir):
        raise NotADirectoryError(
            f"site directory {site_dir!r} does not exist; pass an existing site-packages "
            f"directory (this interpreter's is {default_site_dir()!r})"
        )
    return site_dir


def _refuse_foreign(files: list[StartupFile], action: str) -> None:
    foreign = [f.path for f in files if f.present and not f.ours]
    if foreign:
        raise ForeignStartupFile(
            f"refusing to {action} {', '.join(foreign)}: the file exists with content that is not "
            f"megatron-rl-patches' start-up line; inspect it and move it away first"
        )


def install(site_dir: str | None = None) -> list[tuple[str, str]]:
    """Write both start-up files into `site_dir` (default: this interpreter's site-packages).

    Idempotent; returns (path, "written" | "unchanged") pairs. Refuses, changing nothing, when
    a file of the same name with other content is there.
    """
    site_dir = _checked_dir(site_dir)
    files = inspect_dir(site_dir)
    _refuse_foreign(files, "overwrite")
    done = []
    for name, state in zip(CONTENTS, files):
        if state.current:
            done.append((state.path, "unchanged"))
            continue
        tmp = f"{state.path}.tmp{os.getpid()}"  # not *.pth: site never reads a half-written file
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(CONTENTS[name])
            os.replace(tmp, state.path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        done.append((state.path, "written"))
    return done


def remove(site_dir: str | None = None) -> list[tuple[str, str]]:
    """Remove both start-up files from `site_dir`; returns (path, "removed" | "absent") pairs.

    Idempotent; refuses, changing nothing, when a file of the same name is not ours.
    """
    site_dir = _checked_dir(site_dir)
    files = inspect_dir(site_dir)
    _refuse_foreign(files, "remove")
    done = []
    for state in files:
        if state.present:
            os.remove(state.path)
            done.append((state.path, "removed"))
        else:
            done.append((state.path, "absent"))
    return done


def is_site_dir(path: str) -> bool:
    """Whether this interpreter reads .pth files from `path` at start-up."""
    real = os.path.realpath(path)
    return any(os.path.realpath(d) == real for d in site_dirs())

