"""`megatron-rl-patches bench --quick` runs every benchmark and writes its CSV files and plots."""
import csv
import importlib.util

import pytest

from megatron_rl_patches.apps.cli import main

# `bench all --quick` (27 s) runs on the main lane only: each benchmark's own test covers it on
# every lane where it touches megatron-core; the version-dependent part (the re-entrant crash
# unpatched) is checked per lane below (about 4 s).
pytestmark = pytest.mark.slow


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
    assert all("below measurement resolution" in row["note"] and not row.get("peak_MiB") for row in topk)
    logprobs = _rows(tmp_path / "logprobs.csv")
    measured = [row for row in logprobs if row["time_s"]]
    assert measured and all(not row.get("peak_U") and not row.get("held_U") and float(row["saved_U"]) > 0
                            for row in measured)
    _check_reentrant_rows(tmp_path / "reentrant.csv")
    assert not (tmp_path / "teacher_layout.csv").exists()  # a spawned world: left out of `all --quick`


@pytest.mark.megatron
def test_bench_reentrant_reports_the_unpatched_crash_on_this_megatron_core(tmp_path, capsys):
    assert main(["bench", "reentrant", "--quick", "--out", str(tmp_path)]) == 0
    assert "re-entrant patches" in capsys.readouterr().out
    _check_reentrant_rows(tmp_path / "reentrant.csv")


def _check_reentrant_rows(path):
    reentrant = {row["case"]: row for row in _rows(path)}
    assert all(float(row["patched_us"]) > 0 for row in reentrant.values())
    # the unpatched crash is reported as one, and no overhead is ever negative or NaN
    crash = reentrant["repeated disable_forward_pre_hook"]
    assert crash["note"] == "unpatched: crashes (KeyError)" and crash["unpatched_us"] == crash["overhead_us"] == ""
    overheads = [row["overhead_us"] for row in reentrant.values() if row["overhead_us"]]
    assert all(float(value) >= 0 for value in overheads)
    assert all(row["note"] == "difference below timing noise" for row in reentrant.values()
               if row["unpatched_us"] and not row["overhead_us"])


def test_bench_rejects_an_unknown_benchmark(capsys):
    assert main(["bench", "nonsense"]) == 2
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err
