"""A long benchmark is never silent (issue 110 item 10): `ticking` prints a line at least every
`every` seconds while its block runs and none after; `CaseLines` a line as each case ends; `bench
NAME` runs each benchmark inside a ticker of 30 s."""
from __future__ import annotations

import io
import re
import time

import pytest

from megatron_rl_patches.apps.bench.progress import HEARTBEAT_S, CaseLines, ticking


def test_a_line_every_interval_while_the_block_runs_and_none_after():
    out = io.StringIO()
    with ticking("bench x", every=0.05, stream=out):
        time.sleep(0.33)
    lines = out.getvalue().splitlines()
    assert 4 <= len(lines) <= 7, lines
    assert all(re.fullmatch(r"  bench x: still running \(\d+ s\)", line) for line in lines), lines
    time.sleep(0.15)
    assert out.getvalue().splitlines() == lines  # stopped with the block


def test_a_block_shorter_than_the_interval_prints_nothing_and_an_error_still_stops_it():
    out = io.StringIO()
    with ticking("bench x", every=5.0, stream=out):
        pass
    assert out.getvalue() == ""
    with pytest.raises(RuntimeError, match="case broke"), ticking("bench y", every=0.02, stream=out):
        raise RuntimeError("case broke")
    printed = out.getvalue()
    time.sleep(0.1)
    assert out.getvalue() == printed  # stopped by the error too


@pytest.mark.parametrize("every", [0, -1.0, float("nan")])
def test_an_interval_that_is_no_positive_number_is_refused_by_name(every):
    with pytest.raises(ValueError, match=r"every=.*must be > 0"):
        ticking("bench x", every=every)


def test_a_line_as_each_case_ends():
    out = io.StringIO()
    lines = CaseLines(2, stream=out)
    lines.ended("P=48, R=8, G=4")
    lines.ended("T=1024", failed=True)
    first, second = out.getvalue().splitlines()
    assert re.fullmatch(r"  case 1/2 done \(\d+\.\d s\): P=48, R=8, G=4", first), first
    assert re.fullmatch(r"  case 2/2 failed \(\d+\.\d s\): T=1024", second), second


def test_bench_runs_each_benchmark_inside_a_ticker_of_30_s(monkeypatch, capsys):
    from megatron_rl_patches.apps.bench import windows
    from megatron_rl_patches.apps.cli import bench, main

    assert HEARTBEAT_S <= 30
    monkeypatch.setattr(bench, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(windows, "run", lambda quick, out_dir: time.sleep(0.3) or [{"case": "x"}])
    assert main(["bench", "windows", "--quick"]) == 0
    err = capsys.readouterr().err
    assert len(re.findall(r"(?m)^  bench windows: still running \(\d+ s\)$", err)) >= 3, err
