"""`bench ops` smoke test (tiny shapes): today's ops against HEAD's, interleaved, table and ratios
printed, ops.md written; a revision git cannot export is refused by name."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_bench_ops_runs_every_op_against_a_revision(tmp_path, capsys, monkeypatch):
    from megatron_rl_patches.apps.bench import ops
    from megatron_rl_patches.apps.cli import main

    monkeypatch.setattr(ops, "OPS", ("log_probs_and_entropy", "topk_ids", "lm_head_log_probs_and_entropy"))
    assert main(["bench", "ops", "--baseline", "HEAD", "--T", "16", "--V", "64", "--H", "8", "--runs", "1",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "slime's Function" in out and "the logits path" in out
    table = (tmp_path / "ops.md").read_text()
    for op in (*ops.OPS, *ops.REFERENCES):
        assert f"| {op} |" in table


def test_bench_ops_refuses_an_unknown_revision(capsys):
    from megatron_rl_patches.apps.cli import main

    assert main(["bench", "ops", "--baseline", "no-such-revision-xyz", "--runs", "1"]) != 0
    assert "--baseline no-such-revision-xyz" in capsys.readouterr().err
