"""`bench distill --quick`: both routes for every divergence with 1 and 2 teachers, ours timed
against the dense route, memory figures left out below the measurement's resolution, CSV/markdown
written."""
from __future__ import annotations

import csv

import pytest

pytestmark = pytest.mark.slow


def test_quick_distill_bench_runs_every_case(tmp_path, capsys):
    from megatron_rl_patches.apps.cli import main
    from megatron_rl_patches.ops._divergences import DIVERGENCES  # the bench runs every row of the table

    assert main(["bench", "distill", "--quick", "--out", str(tmp_path)]) == 0
    assert "full-vocabulary distillation step" in capsys.readouterr().out
    assert (tmp_path / "distill.csv").exists() and (tmp_path / "distill.md").exists()
    text = (tmp_path / "distill.md").read_text()
    for divergence in DIVERGENCES:
        assert text.count(f"| {divergence} |") == 4, divergence  # 2 teacher counts x 2 routes
    assert "error" not in text
    rows = list(csv.DictReader(open(tmp_path / "distill.csv", newline="")))
    ours = [r for r in rows if r["implementation"].startswith("ours")]
    assert len(rows) == 4 * len(DIVERGENCES) and len(ours) == 2 * len(DIVERGENCES)
    assert all(float(r["time_s"]) > 0 and float(r["time_vs_dense"]) > 0 and "below measurement" in r["note"]
               for r in ours)
