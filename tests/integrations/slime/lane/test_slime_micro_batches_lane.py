"""slime 624b824a's real rollout manager schedules `--use-dynamic-batch-size --max-tokens-per-gpu N`
micro-batches in the tokens the model computes with shared-prefix packing on (`slime_fused`, issue
111 item 7): 8 groups of 8 samples at P = 1,024, R = 128 and N = 9,216 take 8 micro-batches counted
whole and 2 counted as computed (each group whole, every micro-batch's plan within N), at data-parallel
sizes 1 and 2; with the setting off, or unpatched, slime's own schedule to the index. One fresh
interpreter per case (slime_micro_batches.py), as slime_rollout_split.py runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slime
HERE = os.path.dirname(__file__)


def schedule(patched: bool, shared: str) -> dict:
    env = {**os.environ, "MEGATRON_RL_PATCHES_SHARED_PREFIX": shared}
    env.pop("MEGATRON_RL_PATCHES", None)
    done = subprocess.run([sys.executable, os.path.join(HERE, "slime_micro_batches.py"),
                           "patched" if patched else "unpatched"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_slimes_own_schedule_counts_the_tokens_the_model_computes_with_sharing_on(slime_cpu):
    unpatched = schedule(False, "1")
    assert unpatched["wrapped"] == [False]
    (whole,) = unpatched["dp1"]
    assert len(whole["micro_batches"]) == 8 and max(whole["logical"]) <= 9216  # 8 samples of 1,152 each
    off = schedule(True, "0")
    assert off["wrapped"] == [True] and (off["dp1"], off["dp2"]) == (unpatched["dp1"], unpatched["dp2"])

    shared = schedule(True, "1")
    assert shared["wrapped"] == [True]
    (one,) = shared["dp1"]
    assert len(one["micro_batches"]) == 2 and one["num_microbatches"] == [2]
    assert sorted(i for batch in one["micro_batches"] for i in batch) == list(range(64))
    assert all(physical <= 9216 < logical for physical, logical in zip(one["physical"], one["logical"]))
    for batch in one["micro_batches"]:  # each group whole in one micro-batch: 4 groups of 8, 8,192 tokens computed
        assert sorted(batch) == sorted(g * 8 + m for g in {i // 8 for i in batch} for m in range(8))
    assert one["physical"] == [4 * (1024 + 8 * 128)] * 2
    two = shared["dp2"]  # two ranks: one micro-batch each, the step's samples once
    assert [rank["num_microbatches"] for rank in two] == [[1], [1]]
    assert sorted(i for rank in two for i in rank["partition"]) == list(range(64))
    assert all(p <= 9216 for rank in two for p in rank["physical"])
