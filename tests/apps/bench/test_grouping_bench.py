"""`bench grouping --quick`: both calls over samples sharing one prompt and sharing nothing, at
three sizes each 4x the last, with the ratio to the quarter-size row; one group where all share."""
from __future__ import annotations

import csv

from megatron_rl_patches.apps.bench.grouping import QUICK, SHAPES
from megatron_rl_patches.apps.cli import main


def test_quick_grouping_bench_times_each_size_against_a_quarter_of_it(tmp_path, capsys):
    assert main(["bench", "grouping", "--quick", "--out", str(tmp_path)]) == 0
    assert "grouping by value" in capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "grouping.csv", newline="")))
    sizes = QUICK["sizes"]
    assert [(row["samples_share"], row["call"], int(row["n"])) for row in rows] == [
        (shape, call, n) for shape in SHAPES for call in ("find_groups", "shared_prefix_micro_batches")
        for n in sizes]
    for first, *rest in (rows[i:i + len(sizes)] for i in range(0, len(rows), len(sizes))):
        assert first["vs_quarter"] == "" and all(float(row["cpu_s"]) >= 0 for row in [first, *rest])
        for before, row in zip([first, *rest], rest):
            assert float(row["vs_quarter"]) == float(row["cpu_s"]) / float(before["cpu_s"])
    one = [row for row in rows if row["samples_share"] == "one prompt"]
    assert all(row["groups"] == "1" for row in one if row["call"] == "find_groups")
    budget_samples = 8  # the budget holds 8 whole samples, and a group of n shares its prompt
    assert [int(row["micro_batches"]) for row in one if row["call"] != "find_groups"] == [
        -(-n * QUICK["response"] // (8 * (QUICK["prompt"] + QUICK["response"]) - QUICK["prompt"]))
        for n in sizes] != [n // budget_samples for n in sizes]
