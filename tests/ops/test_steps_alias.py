"""`megatron_rl_patches.ops.steps` (dissolved into the modules its steps belong to) stays an alias:
importing it warns once with a DeprecationWarning and gives the very functions of their new homes;
no module of the package imports it."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

import megatron_rl_patches
from megatron_rl_patches.ops import _checks, _functions, _stats
from megatron_rl_patches.ops.kernels import torch_tiles

ALIAS = "megatron_rl_patches.ops.steps"


def test_the_alias_warns_once_and_re_exports_the_moved_steps(monkeypatch):
    monkeypatch.delitem(sys.modules, ALIAS, raising=False)
    with pytest.warns(DeprecationWarning, match="ops.steps is deprecated"):
        steps = importlib.import_module(ALIAS)
    homes = {"moved": _stats, "moved_stats": _stats, "require_good_rows": _checks, "save_tau": _functions,
             "saved_scale": _functions, "accumulate": torch_tiles}
    assert sorted(steps.__all__) == sorted(homes)
    for name, home in homes.items():
        assert getattr(steps, name) is getattr(home, name), name


def test_no_module_of_the_package_imports_the_alias():
    root = Path(megatron_rl_patches.__file__).parent
    users = [str(path.relative_to(root)) for path in root.rglob("*.py")
             if path.name != "steps.py" and re.search(r"ops\.steps\b|ops import .*\bsteps\b", path.read_text())]
    assert users == []
