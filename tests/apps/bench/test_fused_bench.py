"""`bench fused --quick`: the three implementations side by side, the OPD rows with 1 and 2
teachers, memory figures left out below the measurement's resolution, CSV/markdown written;
`bench fused --only opd` runs the OPD rows alone."""
from __future__ import annotations

import csv

import pytest

pytestmark = pytest.mark.slow


def test_quick_fused_bench_runs_every_case(tmp_path):
    from megatron_rl_patches.apps.bench import fused

    rows = fused.run(quick=True, out_dir=str(tmp_path))
    logprob = [r for r in rows if "time_s" in r and "teachers" not in r]
    assert [r["implementation"] for r in logprob] == ["naive autograd", "logits path", "ours (fused)"]
    assert all(r["time_s"] > 0 and "below measurement resolution" in r["note"] for r in logprob)
    assert next(r for r in logprob if r["implementation"] == "logits path")["time_vs_logits"] == 1.0
    opd = [r for r in rows if "teachers" in r]
    assert {(r["teachers"], r["implementation"]) for r in opd} == {
        (n, impl) for n in (1, 2) for impl in ("logits path", "ours (fused)")
    }
    fused_opd = [r for r in opd if r["implementation"] == "ours (fused)"]
    assert all(r["teacher_logits_MiB"] == 0 for r in fused_opd)  # teachers never build [T, V] logits
    assert all(r["teacher_logits_MiB"] > 0 and r["time_vs_logits"] == 1.0 for r in opd if r not in fused_opd)
    assert all(not r["note"].startswith("error") for r in rows)
    assert (tmp_path / "fused.csv").exists() and (tmp_path / "fused.md").exists()


def test_only_opd_runs_the_opd_rows_alone(tmp_path, capsys):
    from megatron_rl_patches.apps.cli import main

    assert main(["bench", "fused", "--quick", "--only", "opd", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "top-k OPD step" in out and "log-prob + entropy with grads" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused.md", "fused_opd.csv"]
    with open(tmp_path / "fused_opd.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted((r["teachers"], r["implementation"]) for r in rows) == [
        (n, impl) for n in ("1", "2") for impl in ("logits path", "ours (fused)")
    ]
    assert all(float(r["time_s"]) > 0 for r in rows)


def test_only_names_a_part_of_bench_fused(capsys):
    from megatron_rl_patches.apps.bench import fused
    from megatron_rl_patches.apps.cli import bench, main

    assert bench.FUSED_PARTS == fused.PARTS  # the CLI's copy, kept so that --help imports no torch
    with pytest.raises(ValueError, match="only must be one of \\('logprob', 'opd', 'invariant'\\)"):
        fused.run(quick=True, only="naive")
    assert main(["bench", "topk", "--only", "opd"]) == 2
    assert "selects a part of `bench fused`" in capsys.readouterr().err
    assert main(["bench", "fused", "--only", "loss"]) == 2
    assert "invalid choice: 'loss'" in capsys.readouterr().err
    from megatron_rl_patches.apps.bench import logprobs

    assert bench.LOGPROBS_PARTS == logprobs.PARTS
    assert main(["bench", "topk", "--only", "invariant"]) == 2  # a part of bench fused and bench logprobs only
    assert "`bench logprobs`" in capsys.readouterr().err


def test_the_invariant_parts_time_both_modes():
    """`bench fused --only invariant` and `bench logprobs --only invariant` (quick shapes): ours in the
    default and the invariant mode, each row timed, the ratio against the default mode's row."""
    from megatron_rl_patches.apps.bench import fused, logprobs

    rows = fused.run(quick=True, only="invariant")
    assert [r["implementation"] for r in rows] == ["ours (fused)", "ours (fused), invariant"]
    assert all(r["time_s"] > 0 and "time_vs_logits" in r for r in rows)
    rows = logprobs.run(quick=True, only="invariant")
    assert [(r["task"], r["implementation"]) for r in rows] == [
        ("grad", "ours"), ("grad", "ours, invariant"), ("metric", "ours"), ("metric", "ours, invariant")]
    assert all(r["time_s"] > 0 and r["time_vs_naive"] > 0 for r in rows)
