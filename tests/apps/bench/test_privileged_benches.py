"""`bench context --quick` and `bench self-teacher --quick` (privileged contexts): every case
measured on a tiny GPTModel, the rows lined up (the same response rows in every case, the control's
scores equal to the no-context ones bit for bit), the live self-teacher holding no weights of its
own where the snapshot holds the student's, both scoring alike; the tables, CSV and plots written."""
from __future__ import annotations

import csv
import importlib.util

import pytest

pytestmark = pytest.mark.slow  # a GPTModel world (and a case worker): the main lane only


def rows_of(path) -> dict:
    rows = list(csv.DictReader(open(path, newline="")))
    key = "case" if "case" in rows[0] else "teacher"
    return {row[key]: row for row in rows}


def test_quick_context_bench_scores_every_context_length(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    from megatron_rl_patches.apps.bench.context_pass import CONTROL, QUICK, WITHOUT, label
    from megatron_rl_patches.apps.cli import main

    assert main(["bench", "context", "--quick", "--out", str(tmp_path)]) == 0
    assert "teacher pass with a privileged context" in capsys.readouterr().out
    rows = rows_of(tmp_path / "context_pass.csv")
    assert list(rows) == [WITHOUT, CONTROL, *(label(n) for n in QUICK["contexts"])]
    rows_scored = QUICK["samples"] * QUICK["response"]
    assert {int(row["response_rows"]) for row in rows.values()} == {rows_scored}
    assert float(rows[CONTROL]["max_abs_diff"]) == 0 == float(rows[WITHOUT]["max_abs_diff"])
    for length in QUICK["contexts"]:
        row = rows[label(length)]
        assert int(row["teacher_tokens"]) == QUICK["samples"] * (length + QUICK["response"])
        assert float(row["step_ms"]) > 0 and float(row["splice_ms"]) > 0
    assert "| context = the sample's own prompt |" in (tmp_path / "context_pass.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:  # the [bench] extra
        assert (tmp_path / "context_pass.png").stat().st_size > 0


def test_quick_self_teacher_bench_holds_no_second_copy(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    from megatron_rl_patches.apps.bench.live_teacher import TEACHERS
    from megatron_rl_patches.apps.cli import main

    assert main(["bench", "self-teacher", "--quick", "--out", str(tmp_path)]) == 0
    assert "live self-teacher against a snapshot teacher" in capsys.readouterr().out
    rows = rows_of(tmp_path / "self_teacher.csv")
    live, snapshot = rows[TEACHERS["live"]], rows[TEACHERS["snapshot"]]
    assert float(live["own_weights_MiB"]) == 0
    assert float(snapshot["own_weights_MiB"]) == float(snapshot["student_weights_MiB"]) > 0
    # the live teacher's fused head sums in float32, the snapshot's float64 log-softmax of float32 logits
    assert float(live["max_abs_diff"]) == 0 and float(snapshot["max_abs_diff"]) < 1e-5
    assert "below RSS resolution" in live["note"] and not live["peak_MiB"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "self_teacher.png").stat().st_size > 0
    # verl's self-teacher pass: the logits route held [R, V] float64 (2x the float32 term), the fused head none
    passes = list(csv.DictReader(open(tmp_path / "self_teacher_pass.csv", newline="")))
    before, after = (next(row for row in passes if row["route"].startswith(side)) for side in ("before", "after"))
    logits = float(before["logits_RV_MiB"])
    assert float(before["largest_MiB"]) >= 2 * logits and float(after["largest_MiB"]) < logits, passes
    assert float(after["peak_MiB"]) < float(before["peak_MiB"]) / 1.5 and float(after["max_abs_diff"]) < 1e-5
