"""The benchmarks of issue 82: `bench share-scores` (pickled vs tensors across a 2-rank gloo world:
its quick run writes its rows, both ways receive the states bit for bit, the ratio is a ratio) and
`bench hidden-dtypes` (each embed dtype's bytes and errors: float32 exact for a float32 model's
states, the errors ordered by the dtypes' mantissas, the divergences non-negative)."""
from __future__ import annotations

import csv

import pytest
import torch

from megatron_rl_patches.apps.bench.hidden_dtypes import errors


def test_hidden_dtype_errors_follow_the_dtypes_precision():
    gen = torch.Generator().manual_seed(0)
    states, weight = torch.randn(64, 32, generator=gen), torch.randn(500, 32, generator=gen) * 0.5
    tokens = torch.randint(0, 500, (64,), generator=gen)
    got = {dtype: errors(states, tokens, weight, dtype, 8) for dtype in
           (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)}
    assert all(value == 0 for value in got[torch.float32].values())
    order = [got[d]["fwd_kl_mean"] for d in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)]
    assert order == sorted(order) and order[0] > 0
    assert all(got[d][name] >= 0 for d in got for name in ("fwd_kl_max", "rev_kl_max"))
    assert got[torch.float8_e5m2]["token_lp_max_err"] > got[torch.bfloat16]["token_lp_max_err"]


@pytest.mark.multirank
@pytest.mark.slow
def test_share_scores_quick_writes_both_ways_bit_for_bit(tmp_path):
    from megatron_rl_patches.apps.cli import main

    assert main(["bench", "share-scores", "--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "share_scores.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [row["way"] for row in rows] == ["pickled (broadcast_object_list)", "tensors (share_tensors)"]
    assert float(rows[0]["vs_pickled"]) == 1 and float(rows[1]["vs_pickled"]) > 0
    assert not any("DIFFER" in row["note"] or row.get("error") for row in rows)
