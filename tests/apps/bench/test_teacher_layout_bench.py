"""`bench teacher-layout --quick`: the student's layout, TeacherLayout(tp=1) and TeacherLayout(tp=2)
each timed against the student's layout on 2 gloo ranks; at tp=2 each rank holds exactly half of
the split weights (the norms whole) and reads about half of the checkpoint, at the student's layout
the whole of both; the scores agree; the table, CSV and plot are written. A megatron-core without
ProcessGroupCollection (0.13) is refused by name before any rank is spawned."""
from __future__ import annotations

import csv
import importlib.util
import json

import pytest

# The benchmark's run is checked on the main lane only (like `bench all --quick`): the teacher
# layout it times is checked on every lane by tests/inference/teacher_layout; the refusal on a
# megatron-core without ProcessGroupCollection runs on every lane (the `megatron` mark).
pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def _norm_bytes() -> int:
    """fp32 bytes of the quick teacher's norms (every rank holds them whole at any tp)."""
    from megatron_rl_patches.apps.bench.teacher_layout import QUICK
    from megatron_rl_patches.inference.loading.hf.families import architecture
    from megatron_rl_patches.inference.loading.hf.names import checkpoint_tensors
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config

    shapes = checkpoint_tensors(architecture(tiny_hf_config("qwen3", **QUICK["config"])))
    return sum(4 * shape[0] for name, shape in shapes.items() if name.endswith("norm.weight"))


def _collections() -> bool:
    """Whether this megatron-core has ProcessGroupCollection (a teacher layout needs it: >= 0.15)."""
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.megatron
def test_a_megatron_core_without_process_group_collections_is_refused_before_the_spawn(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    if _collections():
        pytest.skip("this megatron-core serves a teacher layout")
    from megatron.core import package_info

    from megatron_rl_patches.apps.cli import PROBLEM, main

    assert main(["bench", "teacher-layout", "--quick", "--out", str(tmp_path)]) == PROBLEM
    err = capsys.readouterr().err
    assert "needs megatron-core's ProcessGroupCollection" in err and package_info.__version__ in err
    assert "multirank" not in err  # refused in this process: no world was spawned


def test_quick_teacher_layout_bench_holds_half_the_teacher_per_rank_at_tp2(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    if not _collections():
        pytest.skip("a teacher layout needs megatron-core >= 0.15 (ProcessGroupCollection)")
    from megatron_rl_patches.apps.bench.teacher_layout import STUDENT
    from megatron_rl_patches.apps.cli import main

    assert main(["bench", "teacher-layout", "--quick", "--out", str(tmp_path)]) == 0
    assert "teacher layout: one micro-batch per rank scored" in capsys.readouterr().out
    with open(tmp_path / "teacher_layout.csv", newline="") as fh:
        rows = {row["layout"]: row for row in csv.DictReader(fh)}
    assert list(rows) == [STUDENT, "TeacherLayout(tp=1)", "TeacherLayout(tp=2)"]
    assert float(rows[STUDENT]["vs_student"]) == 1.0
    for row in rows.values():
        assert float(row["step_ms"]) > 0 and float(row["vs_student"]) > 0 and not row.get("error")
        assert float(row["max_abs_diff"]) <= 1e-5  # the same teacher: its scores agree at every layout
    whole = json.loads(rows[STUDENT]["weights_bytes_by_rank"])
    assert whole[0] == whole[1] == json.loads(rows["TeacherLayout(tp=1)"]["weights_bytes_by_rank"])[0]
    norms = _norm_bytes()
    # tp=2: half of every split weight (the padded vocab 1024 -> 512 rows per rank), the norms whole
    assert json.loads(rows["TeacherLayout(tp=2)"]["weights_bytes_by_rank"]) == [(whole[0] - norms) // 2 + norms] * 2
    assert 0.5 < float(rows["TeacherLayout(tp=2)"]["weights_share"]) < 0.51
    checkpoint = int(rows[STUDENT]["checkpoint_bytes"])
    assert json.loads(rows[STUDENT]["read_bytes_by_rank"]) == [checkpoint, checkpoint]
    halves = json.loads(rows["TeacherLayout(tp=2)"]["read_bytes_by_rank"])
    assert all(0.45 * checkpoint < read < 0.56 * checkpoint for read in halves), halves
    assert sum(halves) == checkpoint + norms  # disjoint halves but for the norms, read by both
    assert "| TeacherLayout(tp=2) |" in (tmp_path / "teacher_layout.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:  # the [bench] extra
        assert (tmp_path / "teacher_layout.png").stat().st_size > 0
