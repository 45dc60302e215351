""".ci/run names the machine before `make test` (issue 86 item 0: the suite's bits follow the CPU's
kernels, so a failure must say which CPU it ran on): its model, whether it has AVX-512 and AMX —
from lscpu, or from /proc/cpuinfo where lscpu is missing. `make` is a stand-in here."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPUINFO = Path("/proc/cpuinfo")


def _run(tmp_path: Path, with_lscpu: bool) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text('#!/bin/sh\necho "make $*"\n')
    (bin_dir / "make").chmod(0o755)
    tools = ["dirname", "sed", "head", "grep", "tr", "nproc"] + (["lscpu"] if with_lscpu else [])
    for tool in tools:
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} is not installed here")
        (bin_dir / tool).symlink_to(found)
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run([bash, str(ROOT / ".ci" / "run")], env={**os.environ, "PATH": str(bin_dir)},
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.splitlines()


def _cpuinfo(field: str) -> str:
    for line in CPUINFO.read_text().splitlines():
        if line.split(":")[0].strip() == field:
            return line.split(":", 1)[1].strip()
    return ""


@pytest.mark.skipif(not CPUINFO.exists(), reason="no /proc/cpuinfo to compare with")
@pytest.mark.parametrize("with_lscpu", [True, False], ids=["lscpu", "no lscpu"])
def test_the_cpu_is_named_before_make_test(tmp_path, with_lscpu):
    if with_lscpu and shutil.which("lscpu") is None:
        pytest.skip("lscpu is not installed here")
    lines = _run(tmp_path, with_lscpu)
    flags = _cpuinfo("flags").split()
    amx = " ".join(flag for flag in flags if flag.startswith("amx")) or "no"
    wide = "yes" if any(flag.startswith("avx512") for flag in flags) else "no"
    assert lines[0].startswith(f"cpu: {_cpuinfo('model name')}; "), lines
    assert f"AVX-512: {wide}" in lines[0] and lines[0].endswith(f"AMX: {amx}"), lines
    assert lines[1:] == ["make test"], lines
