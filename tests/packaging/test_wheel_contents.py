"""The built wheel ships exactly the source tree's modules: nothing left over from an earlier build
(a moved `cli.py` must not ship beside `cli/`), nothing beside the package but its metadata and
the start-up files."""
from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from megatron_rl_patches.patching.startup import files as startup

REPO = Path(__file__).resolve().parents[2]


def tree_modules(package: Path) -> set[str]:
    """The .py files under `package`, as wheel paths."""
    return {
        f"megatron_rl_patches/{path.relative_to(package).as_posix()}"
        for path in package.rglob("*.py")
        if "__pycache__" not in path.parts
    }


@pytest.mark.slow
def test_wheel_modules_equal_the_source_tree(built_wheel):
    source = tree_modules(REPO / "megatron_rl_patches")
    assert tree_modules(built_wheel.source / "megatron_rl_patches") == source  # it was built from this tree
    with zipfile.ZipFile(built_wheel.path) as archive:
        names = archive.namelist()
    shipped = {name for name in names if name.endswith(".py")}
    assert "megatron_rl_patches/apps/cli/__init__.py" in shipped
    assert shipped == source, {"stale": sorted(shipped - source), "missing": sorted(source - shipped)}
    for stale in built_wheel.stale:
        assert stale not in shipped
        # the build emptied the build/lib the stale modules were planted in (it built in place)
        assert not (built_wheel.source / "build" / "lib" / stale).exists()
    (dist_info,) = {name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info")}
    assert {name.split("/")[0] for name in names} == {"megatron_rl_patches", dist_info, *startup.CONTENTS}
    assert "megatron_rl_patches/py.typed" in names


def test_no_module_beside_a_package_of_the_same_name():
    """`cli.py` beside `cli/`: the package wins at import, the module is dead code that would ship."""
    package = REPO / "megatron_rl_patches"
    shadowed = [
        folder.with_suffix(".py").relative_to(REPO).as_posix()
        for folder in [package, *package.rglob("*")]
        if folder.is_dir() and (folder / "__init__.py").exists() and folder.with_suffix(".py").exists()
    ]
    assert shadowed == []
