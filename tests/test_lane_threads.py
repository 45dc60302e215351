"""The megatron lanes' pytest-xdist workers each run torch on their share of the cores
(Makefile `THREADS`: OMP_NUM_THREADS = cores / workers, at least 1, a caller's own value kept;
none set when `WORKERS=0` runs the tests one at a time): two workers of two OpenMP threads on two
cores spun against each other. `make -n` prints the lanes' command lines without running them."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LANES = {"test-main": ".venv/bin/python -m pytest", "test-oldest": ".venv-mcore013/bin/python -m pytest",
         "test-newest": ".venv-mcore019/bin/python -m pytest"}


def pytest_line(lane: str, *settings: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed here")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    out = subprocess.run(["make", "-n", "--no-print-directory", lane, *settings], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    lines = [line for line in out.splitlines() if LANES[lane] in line]
    if not lines and lane == "test-newest":
        pytest.skip("no Python 3.12 here: the newest lane is skipped")
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.parametrize("lane", sorted(LANES))
@pytest.mark.parametrize("workers", [2, 3, 1])
def test_each_worker_takes_its_share_of_the_cores(lane, workers):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = max(1, cores // workers)  # nproc counts the cores this process may run on
    line = pytest_line(lane, f"WORKERS={workers}")
    assert f"OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{share}}} " in line and f"-n {workers} --dist loadfile" in line, line


@pytest.mark.parametrize("lane", sorted(LANES))
def test_one_worker_at_a_time_keeps_the_default_threads(lane):
    line = pytest_line(lane, "WORKERS=0")
    assert "OMP_NUM_THREADS" not in line and " -n " not in line, line


def test_a_callers_own_thread_count_is_kept():
    line = pytest_line("test-oldest", "WORKERS=2")
    command = line.replace(".venv-mcore013/bin/python -m pytest", "printenv OMP_NUM_THREADS #")
    got = subprocess.run(["sh", "-c", command], env={**os.environ, "OMP_NUM_THREADS": "7"}, capture_output=True,
                         text=True, check=True).stdout
    assert got.strip() == "7"
