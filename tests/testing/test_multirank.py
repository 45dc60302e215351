"""The kit's world runner: one deadline for the whole world, and forkserver ranks that see the
caller's environment and output as spawned ones do."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = pytest.mark.multirank


def hang(rank: int, world_size: int) -> None:
    time.sleep(3600)


def environment_and_output(rank: int, world_size: int) -> dict[str, object]:
    # one write per line: print's text and newline are two writes, which two ranks interleave
    sys.stdout.write(f"rank {rank} stdout\n")
    sys.stdout.flush()
    sys.stderr.write(f"rank {rank} stderr\n")
    sys.stderr.flush()
    return {"value": os.environ.get("MRP_TEST_MULTIRANK_VALUE"), "cwd": os.getcwd(), "pid": os.getpid()}


def test_a_hanging_world_fails_within_one_timeout():
    # Each rank joined with its own timeout after the queue's took (1 + world) x timeout (12 s here).
    run_multirank(environment_and_output, 1)  # the suite's forkserver started, as in later worlds
    timeout = 3.0
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"no result within 3.0s"):
        run_multirank(hang, 3, timeout=timeout)
    # under 3 timeouts (9 s), where the per-rank joins took 4 (12 s): the rest is spawning and tearing down 3 ranks,
    # 6.4 s once on a loaded 2-core machine (a bound of 2 timeouts failed there)
    assert time.monotonic() - start < 3 * timeout


def test_ranks_see_the_callers_environment_cwd_and_capture(monkeypatch, tmp_path, capfd):
    # The forkserver starts before the change: a rank must still see what the caller has now.
    run_multirank(environment_and_output, 1, start_method="forkserver")
    capfd.readouterr()
    monkeypatch.setenv("MRP_TEST_MULTIRANK_VALUE", "set by this test")
    monkeypatch.chdir(tmp_path)
    for method in ("forkserver", "spawn"):
        results = run_multirank(environment_and_output, 2, start_method=method)
        assert [r["value"] for r in results] == ["set by this test"] * 2, method
        assert [r["cwd"] for r in results] == [str(tmp_path)] * 2, method
        assert len({r["pid"] for r in results} | {os.getpid()}) == 3, method  # a new process per rank
        out, err = capfd.readouterr()
        assert sorted(out.split("\n")[:-1]) == ["rank 0 stdout", "rank 1 stdout"], method
        assert "rank 0 stderr" in err and "rank 1 stderr" in err, method


def test_unknown_start_method_is_refused_by_name():
    with pytest.raises(ValueError, match="start_method='fork'"):
        run_multirank(environment_and_output, 1, start_method="fork")


def test_the_servers_imports_print_nothing_into_the_first_worlds_output():
    # The server's output is whatever the caller had when the first world started (a test's capture):
    # megatron-core's import notes printed there belong to no rank (a spawned rank hides them itself).
    pytest.importorskip("megatron.core")
    code = "from megatron_rl_patches.testing import multirank; multirank.use_forkserver(); " \
           "print(multirank.run_multirank(max, 2))"  # max(rank, world size)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "[2, 2]", proc.stderr[-2000:]
    assert "Warning" not in proc.stderr, proc.stderr[-2000:]
