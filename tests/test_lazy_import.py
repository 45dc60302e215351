"""Importing the package, and running the start-up hook with the variable unset, imports nothing
heavy: every Python process of a machine with the wheel installed pays that cost."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch", "megatron", "wrapt", "packaging", "numpy")

PROBE = textwrap.dedent(
    """
    import json, sys
    before = set(sys.modules)
    {code}
    new = sorted(set(sys.modules) - before)
    print(json.dumps({{"new": new, "stdlib": sorted(sys.stdlib_module_names), "extra": {extra}}}))
    """
)


def probe(code: str, extra: str = "None", **variables: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    environ.update(variables)
    script = PROBE.format(code=code, extra=extra)
    proc = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return json.loads(proc.stdout)


def top_levels(result: dict) -> set[str]:
    return {name.split(".")[0] for name in result["new"]}


def outside_stdlib(result: dict) -> set[str]:
    return top_levels(result) - set(result["stdlib"]) - {"megatron_rl_patches"}


def test_import_package_is_light():
    result = probe("import megatron_rl_patches")
    assert not top_levels(result) & set(HEAVY), result["new"]
    assert outside_stdlib(result) == set()


def test_startup_hook_with_variable_unset_is_light():
    result = probe(
        "import megatron_rl_patches.patching.startup.hook as b; b.run()",
        extra="b.has_run()",
    )
    assert result["extra"] is True
    assert outside_stdlib(result) == set(), result["new"]
    ours = {name for name in result["new"] if name.startswith("megatron_rl_patches")}
    assert ours == {
        "megatron_rl_patches",
        "megatron_rl_patches._lazy",
        "megatron_rl_patches.patching",
        "megatron_rl_patches.patching.startup",
        "megatron_rl_patches.patching.startup.hook",
        "megatron_rl_patches.patching.env",
        "megatron_rl_patches.settings",  # the one table of variables and their parsers (standard library only)
    }


@pytest.mark.parametrize("value", ["", "0"])
def test_startup_hook_with_variable_off_is_light(value):
    result = probe("import megatron_rl_patches.patching.startup.hook as b; b.run()", MEGATRON_RL_PATCHES=value)
    assert outside_stdlib(result) == set(), result["new"]


def test_startup_hook_with_variable_set_only_registers_hooks():
    # The patches land when megatron is imported; start-up itself loads no torch or megatron.
    result = probe(
        "import megatron_rl_patches.patching.startup.hook as b; b.run()\n"
        "import wrapt.importer as w",
        extra="sorted(w._post_import_hooks)",
        MEGATRON_RL_PATCHES="all",
    )
    assert not top_levels(result) & {"torch", "megatron", "numpy"}, result["new"]
    assert "megatron.core.distributed.distributed_data_parallel" in result["extra"]


def test_lazy_public_names_resolve_on_first_use():
    result = probe(
        "import megatron_rl_patches as m\nnames = dir(m)\nfn = m.apply",
        extra="[names, fn.__module__, 'megatron_rl_patches.patching.registry' in sys.modules]",
    )
    names, module, registry_loaded = result["extra"]
    assert {"apply", "revert", "applied", "PatchStatus", "__version__"} <= set(names)
    # apply() lives with the default registry it drives, which is built (wrapt imported) on first call
    assert module == "megatron_rl_patches.integrations" and not registry_loaded
    assert not top_levels(result) & {"torch", "megatron"}
    import megatron_rl_patches

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        megatron_rl_patches.nope  # noqa: B018


def test_the_residency_modes_and_the_sizing_formulas_come_without_torch():
    """The `memory` CLI's imports: the one residency-modes tuple and the formulas, torch-free, through
    the public name and the residency package alike."""
    result = probe(
        "from megatron_rl_patches.inference import RESIDENCY_MODES as a\n"
        "from megatron_rl_patches.inference.residency import RESIDENCY_MODES as b\n"
        "from megatron_rl_patches.inference.sizing import memory, residency_plan",
        extra="[a is b is residency_plan.MODES, list(a)]",
    )
    assert result["extra"] == [True, ["resident", "swap", "stream"]]
    assert outside_stdlib(result) == set(), result["new"]
