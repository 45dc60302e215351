"""`bench windows --quick`: every (load, variant) row is timed on 2 gloo ranks and the CSV written."""
import csv

import pytest

from megatron_rl_patches.apps.bench import windows

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]


def test_windows_bench_quick(tmp_path, capfd):
    rows = windows.run(quick=True, out_dir=str(tmp_path))
    err = capfd.readouterr().err  # the ranks are fresh processes: megatron-core's import notes are hidden there
    assert "Transformer Engine" not in err and "Apex is not installed" not in err, err[-2000:]
    assert [(row["load"], row["variant"]) for row in rows] == [
        (load, v) for load in windows.LOADS for v in windows.VARIANTS]
    patched = [row for row in rows if row["variant"] == "overlap + grad_windows"]
    assert all(row["median_ms"] > 0 and row["vs_sync"] > 0 for row in patched)
    with open(tmp_path / "windows.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)
