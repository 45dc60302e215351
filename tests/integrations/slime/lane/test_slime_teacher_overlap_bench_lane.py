"""`tools/teacher-overlap-bench --quick` (issue 88 items 1 and 5) runs end to end on slime's real
rollout and train_actor with real vLLM CPU servers (the rollout engine's stand-in and one teacher,
tiny shapes): its rows name both routes, the teacher-at-the-rollout route's train step reads every
sample's carried rows (the step's wait in collect() gone) and the CSV, table and plot are written.
The full benchmark's rows: docs/benchmarks.md, "A served teacher off the train step". Without
MRP_VLLM_PYTHON the test skips naming it."""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slime


def test_the_quick_benchmark_runs_and_writes_its_rows(slime_cpu, tmp_path):
    if not os.environ.get("MRP_VLLM_PYTHON"):
        pytest.skip("MRP_VLLM_PYTHON names vLLM's interpreter (the served lane's, .lanes/vllm/bin/python): unset")
    import slime_teacher_overlap_bench as bench

    rows = bench.main(["--quick", "--out", str(tmp_path)])
    assert [row["route"] for row in rows] == ["teacher at the train step", "teacher at the rollout"]
    train, rollout = rows
    assert rollout["collect_wait_s"] < 0.05 and rollout["row_bytes_per_token"] == 8 * 4 + 8
    assert train["total_vs_train_route"] == 1 and rollout["total_vs_train_route"] > 0
    assert {path.name for path in tmp_path.iterdir()} >= {"teacher_overlap.csv", "teacher_overlap.md"}
