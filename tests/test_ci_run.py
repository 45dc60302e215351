""".ci/run names the machine before `make test` (issue 86 item 0: the suite's bits follow the CPU's
kernels, so a failure must say which CPU it ran on): its model, whether it has AVX-512 and AMX —
from lscpu, or from /proc/cpuinfo where lscpu is missing; then the disk's free space (a full disk
failed a CI run in `python -m venv` without saying why), loudly when under 16 GiB. `make` is a
stand-in here."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPUINFO = Path("/proc/cpuinfo")


def _run(tmp_path: Path, with_lscpu: bool, free_kib: int | None = None) -> list[str]:
    """.ci/run's output; `free_kib`: what a stand-in `df` says is free (else the real one)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text('#!/bin/sh\necho "make $*"\n')
    (bin_dir / "make").chmod(0o755)
    if free_kib is not None:
        (bin_dir / "df").write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                                    f"echo '/dev/x 1 1 {free_kib} 99% /'\n")
        (bin_dir / "df").chmod(0o755)
    tools = ["dirname", "sed", "head", "grep", "tr", "nproc", "awk"] + (["lscpu"] if with_lscpu else []) + \
        (["df"] if free_kib is None else [])
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
    free = shutil.disk_usage(ROOT).free // 2**30
    assert lines[1] in (f"disk: {free} GiB free here (the lanes build about 12 GiB)",
                        f"disk: {free - 1} GiB free here (the lanes build about 12 GiB)"), lines  # df rounds down
    assert lines[2:] == ["make test"], lines


@pytest.mark.parametrize(("free_kib", "warned"), [(15 * 2**20 + 2**20 - 1, True), (16 * 2**20, False)])
def test_a_disk_too_full_for_the_lanes_is_said_before_make_test(tmp_path, free_kib, warned):
    lines = _run(tmp_path, with_lscpu=False, free_kib=free_kib)
    assert lines[1] == f"disk: {free_kib // 2**20} GiB free here (the lanes build about 12 GiB)", lines
    warning = "*** disk: under 16 GiB free: the lanes' venvs may not fit (free some space first) ***"
    assert (warning in lines) == warned, lines
    assert lines[-1] == "make test", lines
