"""The quick log-prob benchmark runs end to end and shows what it is for: ours keeps the least."""
from __future__ import annotations

import csv

import pytest
import torch

from megatron_rl_patches.apps.bench import measure, outputs
from megatron_rl_patches.apps.bench.logprobs import QUICK_SHAPES, VARIANTS, run

pytestmark = pytest.mark.slow  # ~30 s: the real benchmark at its smallest shapes


def test_quick_run_writes_csv_and_ours_saves_less_than_naive(tmp_path):
    rows = run(quick=True, out_dir=str(tmp_path))
    assert len(rows) == len(VARIANTS) * len(QUICK_SHAPES)
    with open(tmp_path / "logprobs.csv") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == len(rows)
    assert {"implementation", "task", "saved_U", "time_s", "note"} <= set(table[0])
    # resident-set figures at the quick shape (U = 2 MiB) are noise: left out, and the row says so
    assert all(not row.get("peak_U") and not row.get("held_U") for row in table)
    assert all("below measurement resolution" in row["note"] for row in table if row["time_s"])
    assert (tmp_path / "logprobs.md").read_text().count("\n") == len(rows) + 2
    assert (tmp_path / "logprobs.png").stat().st_size > 0

    measured = [r for r in rows if "saved_bytes" in r]
    assert all("error" not in r["note"] for r in rows), [r["note"] for r in rows]
    for task in ("grad", "metric"):
        naive = next(r for r in measured if r["impl"] == "naive" and r["task"] == task)
        ours = [r for r in measured if r["impl"] == "ours" and r["task"] == task]
        assert len(ours) == 2
        for row in ours:
            # the logits (1 U) plus <= 24 B per token; naive keeps 2 U with an entropy gradient
            # (log-softmax and its exp) and 1 U plus its int64 index otherwise
            assert row["saved_bytes"] <= row["U_bytes"] + 24 * row["T"]
            if task == "grad":
                assert row["saved_bytes"] < naive["saved_bytes"] - 0.9 * row["U_bytes"]
            else:
                assert row["saved_bytes"] <= naive["saved_bytes"] + 24 * row["T"]
            assert row["time_s"] > 0
    fused_grad = next(r for r in measured if r["impl"] == "fused" and r["task"] == "grad")
    assert fused_grad["saved_bytes"] >= 2 * fused_grad["U_bytes"]  # softmax + logits


def test_saved_bytes_counts_each_storage_once_and_skips_ignored():
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 8, requires_grad=True)
    with measure.SavedBytes(ignore=[w]) as saved:
        y = (x @ w).exp()  # mm saves x and w; exp saves its output
        (y * y).sum()  # saves y twice: one storage
    assert saved.bytes == x.numel() * 4 + y.numel() * 4


def test_table_and_csv_helpers(tmp_path):
    rows = [{"a": 1, "b": 0.123456}, {"a": 22, "c": "x"}]
    text = outputs.format_table(rows, ["a", "b"], title="t")
    assert text.splitlines()[0] == "t" and "0.123" in text and "-" in text.splitlines()[-1]
    path = outputs.write_csv(rows, str(tmp_path / "r.csv"))
    assert open(path).read().splitlines()[0] == "a,b,c"
