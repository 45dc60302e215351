"""The built wheel ships exactly the source tree's modules: nothing left over from an earlier build
(a moved `cli.py` must not ship beside `cli/`)."""
from __future__ import annotations

import zipfile

import pytest

pytestmark = [pytest.mark.slow]


def test_wheel_modules_equal_the_source_tree(built_wheel):
    package = built_wheel.source / "megatron_rl_patches"
    source = {f"megatron_rl_patches/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py")}
    with zipfile.ZipFile(built_wheel.path) as archive:
        shipped = {name for name in archive.namelist() if name.endswith(".py")}
    assert "megatron_rl_patches/cli/__init__.py" in shipped
    assert shipped == source, {"stale": sorted(shipped - source), "missing": sorted(source - shipped)}
