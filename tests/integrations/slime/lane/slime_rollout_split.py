"""Run in a fresh interpreter by test_slime_rollout_split_lane.py: slime 624b824a's real rollout
manager module (`slime.ray.rollout`, imported with inert stand-ins for ray and SGLang: its process
needs a cluster and a server otherwise) converting real `Sample`s with `train_metadata` to training
data and splitting it per data-parallel rank, with or without the package's `slime_opd` patch.
Prints one JSON line: per rank its partition, its samples' carried contexts and its keys."""
from __future__ import annotations

import json
import sys
import types

from megatron_rl_patches.testing.service_stubs import SERVICES, install_service_stubs

install_service_stubs((*SERVICES, "sglang", "sglang_router"))

import megatron_rl_patches  # noqa: E402
from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS  # noqa: E402


def main(patched: bool) -> None:
    if patched:
        megatron_rl_patches.apply(only=["slime_opd"], strict=True)
    import slime.ray.rollout as rollout
    from slime.utils.types import Sample

    # ray.put is the object store (a cluster): here the rank's dict itself, as Box(ray.get(...)) sees it
    rollout.ray = types.SimpleNamespace(put=lambda value, **_: value)
    manager = object.__new__(rollout.RolloutManager)
    manager.args = types.SimpleNamespace(
        advantage_estimator="reinforce", rewards_normalization=False, reward_key=None, n_samples_per_prompt=1,
        rollout_batch_size=4,
        micro_batch_size=1, use_dynamic_batch_size=False, max_tokens_per_gpu=None, balance_data=False,
        balance_by_flops=False, global_batch_size=4, rollout_top_p=1.0, rollout_data_transport="object-store")
    manager.custom_convert_samples_to_train_data_func = manager.custom_reward_post_process_func = None
    manager.set_train_parallel_config({"dp_size": 2, "cp_size": 1, "vpp_size": 1,
                                       "microbatch_group_size_per_vp_stage": 1})
    hints = ["the answer is 7", [11, 12, 13], "x = 2", [5]]
    samples = []
    for index, hint in enumerate(hints):
        sample = Sample(index=index, tokens=[1, 2, 3 + index, 4, 5][:3 + index % 3], response_length=2,
                        reward=float(index), train_metadata={"hint": hint, "other": index})
        sample.rollout_id = index
        samples.append(sample)
    data = manager._convert_samples_to_train_data(samples)
    ranks = [box.inner for box in manager._split_train_data_by_dp(data)]
    print(json.dumps({
        "wrapped": [hasattr(rollout.RolloutManager._split_train_data_by_dp, "__wrapped__"),
                    hasattr(rollout.tensorize_rollout_data_for_training, "__wrapped__")],
        "ranks": [{"partition": list(rank["partition"]), "contexts": rank.get(CONTEXTS),
                   "keys": sorted(rank)} for rank in ranks]}))


if __name__ == "__main__":
    main(sys.argv[1] == "patched")
