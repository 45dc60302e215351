"""`bench fused --quick`: the three implementations side by side, the OPD rows with 1 and 2
teachers, memory figures left out below the measurement's resolution, CSV/markdown written."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_quick_fused_bench_runs_every_case(tmp_path):
    from megatron_rl_patches.bench import fused

    rows = fused.run(quick=True, out_dir=str(tmp_path))
    logprob = [r for r in rows if "time_s" in r]
    assert [r["implementation"] for r in logprob] == ["naive autograd", "logits path", "ours (fused)"]
    assert all(r["time_s"] > 0 and "below measurement resolution" in r["note"] for r in logprob)
    assert next(r for r in logprob if r["implementation"] == "logits path")["time_vs_logits"] == 1.0
    opd = [r for r in rows if "teachers" in r]
    assert {(r["teachers"], r["implementation"]) for r in opd} == {
        (n, impl) for n in (1, 2) for impl in ("logits path", "ours (fused)")
    }
    fused_opd = [r for r in opd if r["implementation"] == "ours (fused)"]
    assert all(r["teacher_logits_MiB"] == 0 for r in fused_opd)  # teachers never build [T, V] logits
    assert all(not r["note"].startswith("error") for r in rows)
    assert (tmp_path / "fused.csv").exists() and (tmp_path / "fused.md").exists()
