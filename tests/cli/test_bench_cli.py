"""`megatron-rl-patches bench --quick` runs every benchmark and writes its CSV files and plots."""
import csv
import importlib.util

import pytest

from megatron_rl_patches.cli import main

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_bench_quick_writes_csv_and_png_for_every_benchmark(tmp_path, capsys):
    assert main(["bench", "all", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "top-k OPD loss" in out and "re-entrant patches" in out
    plots = importlib.util.find_spec("matplotlib") is not None  # the optional [bench] extra
    for name in ("logprobs", "topk", "reentrant"):
        assert (tmp_path / f"{name}.csv").stat().st_size > 0
        assert (tmp_path / f"{name}.png").exists() is plots
    topk = _rows(tmp_path / "topk.csv")
    assert {row["impl"] for row in topk} == {"naive", "ours"} and not any(row.get("error") for row in topk)
    traffic = _rows(tmp_path / "topk_traffic.csv")
    assert all(float(row["ratio"]) < 1 for row in traffic)
    reentrant = {row["case"]: row for row in _rows(tmp_path / "reentrant.csv")}
    assert all(float(row["patched_us"]) > 0 for row in reentrant.values())


def test_bench_rejects_an_unknown_benchmark(capsys):
    assert main(["bench", "nonsense"]) == 2
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err
