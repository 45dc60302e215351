"""Which megatron-core is in use: installed wheel, development build, or a source checkout on
PYTHONPATH (no distribution metadata); supported vs tested; patches apply from a checkout."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_rl_patches.integrations.megatron import version as megatron_version
from megatron_rl_patches.integrations.megatron.version import version_from_package_info


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("MAJOR = 0\nMINOR = 19\nPATCH = 2\nPRE_RELEASE = ''\n", "0.19.2"),
        ('MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = "rc0"\n', "0.20.0rc0"),
        ("MAJOR = 0\nMINOR = 16\nPATCH = 0\nPRE_RELEASE = 'rc0'\nVERSION = (MAJOR, MINOR)\n", "0.16.0rc0"),
        ("MAJOR = 0\nMINOR = 13\n", None),  # no PATCH: unknown rather than a guess
        ("", None),
    ],
)
def test_version_from_package_info(text, version):
    assert version_from_package_info(text) == version


@pytest.mark.parametrize(
    ("version", "label"),
    [
        ("0.13.1", "tested"),
        ("0.16.1", "tested"),
        ("0.19.2", "tested"),
        ("0.19.2+abc1234", "tested"),  # a VCS suffix is the same release
        ("0.15.3", "tested"),  # by `make test-versions`
        ("0.15.0", "in range, not run"),
        ("0.20.0rc0", "in range, not run"),  # main
        ("0.12.3", "out of range"),
        ("0.21.0", "out of range"),
        ("garbage", "out of range"),
        (None, "not installed"),
    ],
)
def test_tested_means_a_lane_ran_it(version, label):
    assert megatron_version.tested_label(version) == label


@pytest.mark.megatron
def test_running_lane_version_is_recorded_as_tested():
    """Every lane's own megatron-core must be in TESTED (else the matrix lies about it)."""
    info = megatron_version.megatron_info()
    if info.origin == "source":
        pytest.skip("a source checkout on PYTHONPATH (a one-off run of main), not a lane's installed release")
    assert info.origin == "distribution" and info.version is not None
    assert megatron_version.tested_label(info.version) == "tested", f"add {info.version} to megatron_version.TESTED"


CHILD = textwrap.dedent(
    """
    import json, sys
    import megatron_rl_patches
    from megatron_rl_patches.integrations.megatron.version import megatron_info
    info = megatron_info()  # before any import of megatron
    megatron_rl_patches.apply(only="ddp_hooks")
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel as DDP
    import megatron.core
    statuses = [(s.status, s.code) for s in megatron_rl_patches.applied() if s.name == "ddp_hooks"]
    print(json.dumps({"info": [info.version, info.origin, info.location], "file": megatron.core.__file__,
                      "statuses": statuses, "wrapped": hasattr(DDP.enable_forward_pre_hook, "__wrapped__")}))
    """
)


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.parametrize("pre_release", ["rc0", ""])
def test_patches_apply_from_a_source_checkout(tmp_path, pre_release):
    """A checkout on PYTHONPATH shadows the installed wheel; its package_info gives the version
    (main's 0.20.0rc0, in range, or 0.21.0 out of it) and the patches apply or are skipped."""
    import megatron.core

    installed = Path(megatron.core.__file__).parent
    checkout = tmp_path / "Megatron-LM"
    shutil.copytree(installed, checkout / "megatron" / "core", ignore=shutil.ignore_patterns("__pycache__"))
    info_file = checkout / "megatron" / "core" / "package_info.py"
    fields = {"MINOR": "20" if pre_release else "21", "PATCH": "0", "PRE_RELEASE": repr(pre_release)}
    lines = [
        f"{line.split('=')[0].strip()} = {fields[line.split('=')[0].strip()]}"
        if line.split("=")[0].strip() in fields and not line.startswith(" ")
        else line
        for line in info_file.read_text().splitlines()
    ]
    info_file.write_text("\n".join(lines) + "\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    environ["PYTHONPATH"] = os.pathsep.join([str(checkout), *sys.path])
    proc = subprocess.run([sys.executable, "-c", CHILD], env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    version, origin, location = result["info"]
    assert origin == "source" and Path(location) == (checkout / "megatron" / "core").resolve()
    assert Path(result["file"]).resolve().is_relative_to(checkout.resolve())
    if pre_release:
        assert version == "0.20.0rc0"
        assert result["statuses"] == [["applied", "ok"], ["applied", "ok"]] and result["wrapped"]
    else:
        assert version == "0.21.0"
        assert result["statuses"] == [["skipped", "version_out_of_range"]] * 2 and not result["wrapped"]
