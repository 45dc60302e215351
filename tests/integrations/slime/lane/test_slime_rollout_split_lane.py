"""slime 624b824a's real rollout manager (`slime.ray.rollout.RolloutManager`) carries each sample's
privileged context to the training ranks with the `slime_opd` patch: real `Sample`s holding
`train_metadata` through its own `_convert_samples_to_train_data` and `_split_train_data_by_dp` (and
the `tensorize_rollout_data_for_training` that split calls per rank). slime copies a fixed list of
keys per rank, so unpatched the contexts never arrive (shown first). One fresh interpreter per case
(slime_rollout_split.py): the module is imported with inert stand-ins for ray and SGLang, which the
lane's in-process stand-ins do not cover."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slime
HERE = os.path.dirname(__file__)
TEACHER = "http://127.0.0.1:9;engine=vllm"  # never asked: only the settings are read in the rollout manager


def split(patched: bool, teacher: str) -> dict:
    env = {**os.environ, "MEGATRON_RL_PATCHES_OPD_TEACHERS": teacher, "MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teacher"}
    env.pop("MEGATRON_RL_PATCHES", None)
    done = subprocess.run([sys.executable, os.path.join(HERE, "slime_rollout_split.py"),
                           "patched" if patched else "unpatched"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_slimes_own_rollout_manager_carries_each_ranks_contexts_with_the_patch_only(slime_cpu):
    from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS

    unpatched = split(False, f"{TEACHER};context=hint")  # slime as it is: train_metadata stops at the split
    assert unpatched["wrapped"] == [False, False]
    assert [rank["partition"] for rank in unpatched["ranks"]] == [[0, 2], [1, 3]]
    assert all(rank["contexts"] is None and "metadata" not in rank["keys"] for rank in unpatched["ranks"])

    patched = split(True, f"{TEACHER};context=hint")
    assert patched["wrapped"] == [True, True]
    assert [rank["partition"] for rank in patched["ranks"]] == [[0, 2], [1, 3]]  # slime's own schedule, unchanged
    # only the teacher's key, each rank its own samples' values in partition order, text and ids as given
    assert patched["ranks"][0]["contexts"] == [{"hint": "the answer is 7"}, {"hint": "x = 2"}]
    assert patched["ranks"][1]["contexts"] == [{"hint": [11, 12, 13]}, {"hint": [5]}]
    assert all(set(rank["keys"]) == set(unpatched["ranks"][0]["keys"]) | {CONTEXTS} for rank in patched["ranks"])

    plain = split(True, TEACHER)  # no privileged teacher configured: every rank's data exactly as slime's
    assert [rank["keys"] for rank in plain["ranks"]] == [rank["keys"] for rank in unpatched["ranks"]]
