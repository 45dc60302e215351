"""Which megatron-core is in use, where it comes from, and what "supported" / "tested" mean.

Found without importing megatron: the import system locates `megatron.core` (the `megatron`
namespace package is cheap), and `package_info.py` is read as text. A source checkout on
PYTHONPATH has no distribution metadata, and one may shadow an installed wheel: the version is
always the one of the code that `import megatron.core` would load.
"""
# lazy imports: import cost: the start-up hook loads this module with MEGATRON_RL_PATCHES=all (test_lazy_import)
from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass
from importlib.machinery import PathFinder

DISTRIBUTION = "megatron-core"

# Every release from 0.13 through main's 0.20 development builds: the DDP hook toggles, the
# train() asserts and the dist_checkpointing entry points we use are the same there (CONTEXT.md).
SUPPORTED = ">=0.13,<0.21"

# Versions a lane of this repository's test suite ran, and which lane. `make test` runs the first
# three on every CI run; `make test-versions` ran the others once (date in docs/compatibility.md).
TESTED: dict[str, str] = {
    "0.13.1": "make test (oldest lane, Python 3.11)",
    "0.14.0": "make test-versions (run once, Python 3.11)",
    "0.15.3": "make test-versions (run once, Python 3.11)",
    "0.16.1": "make test (main lane, Python 3.11)",
    "0.17.1": "make test-versions (run once, Python 3.12)",
    "0.18.2": "make test-versions (run once, Python 3.12)",
    "0.19.2": "make test (newest lane, Python 3.12)",
}


@dataclass(frozen=True)
class MegatronInfo:
    """The megatron-core an `import megatron.core` would load (all None when there is none)."""

    version: str | None
    origin: str | None  # "distribution" (an installed wheel) or "source" (a checkout on sys.path)
    location: str | None  # the megatron/core folder


def _core_folder() -> str | None:
    """The folder `import megatron.core` loads (or loaded), found without importing anything."""
    loaded = sys.modules.get("megatron.core")
    if loaded is not None:
        spec = getattr(loaded, "__spec__", None)
    else:
        parent = PathFinder.find_spec("megatron")
        locations = parent.submodule_search_locations if parent is not None else None
        spec = PathFinder.find_spec("megatron.core", list(locations)) if locations else None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(list(spec.submodule_search_locations)[0])


_FIELD = re.compile(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*(?:(\d+)|['\"]([^'\"]*)['\"])", re.MULTILINE)


def version_from_package_info(text: str) -> str | None:
    """'MAJOR = 0 / MINOR = 20 / PATCH = 0 / PRE_RELEASE = "rc0"' -> '0.20.0rc0' (None if absent)."""
    fields = {name: number if number else text_value for name, number, text_value in _FIELD.findall(text)}
    if not all(name in fields for name in ("MAJOR", "MINOR", "PATCH")):
        return None
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE', '')}"


def _distribution_of(folder: str) -> str | None:
    """The installed megatron-core's version when `folder` is that distribution's own files.

    Asked once per folder and install: reading the distribution's metadata costs ~1.5 ms, and a
    registry asks for every patch it installs (apply, doctor). A reinstall rewrites
    `package_info.py`, whose change time is part of the key, so a new install is read afresh."""
    try:
        stamp = os.stat(os.path.join(folder, "package_info.py")).st_mtime_ns
    except OSError:
        stamp = None
    return _distribution_at(folder, stamp)


@functools.lru_cache(maxsize=16)
def _distribution_at(folder: str, stamp: int | None) -> str | None:
    """`_distribution_of` for one folder and `package_info.py` change time (`stamp`: the cache key only)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    files = os.path.realpath(str(dist.locate_file(os.path.join("megatron", "core"))))
    return dist.version if files == folder else None


def megatron_info() -> MegatronInfo:
    """Where megatron-core comes from and its version, without importing it."""
    folder = _core_folder()
    if folder is None:
        return MegatronInfo(None, None, None)
    version = _distribution_of(folder)
    if version is not None:
        return MegatronInfo(version, "distribution", folder)
    try:
        with open(os.path.join(folder, "package_info.py"), encoding="utf-8") as handle:
            version = version_from_package_info(handle.read())
    except OSError:
        version = None
    return MegatronInfo(version, "source", folder)


def installed_version() -> str | None:
    """The version of the megatron-core in use (the records' version finder)."""
    return megatron_info().version


def in_supported_range(version: str, supported: str = SUPPORTED) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(version) in SpecifierSet(supported, prereleases=True)


def tested_label(version: str | None, supported: str = SUPPORTED) -> str:
    """'tested' for a version a lane ran, 'in range, not run', 'out of range' or 'not installed'."""
    if version is None:
        return "not installed"
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).public  # a local '+abc123' build tag is the same release
    except InvalidVersion:
        return "out of range"
    if release in TESTED:
        return "tested"
    return "in range, not run" if in_supported_range(release, supported) else "out of range"
