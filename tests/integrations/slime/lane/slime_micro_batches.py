"""Run in a fresh interpreter by test_slime_micro_batches_lane.py: slime 624b824a's real rollout
manager (`slime.ray.rollout`, ray and SGLang as inert stand-ins) scheduling one step of 8 GRPO groups
(P = 1,024, R = 128, G = 8) with `--use-dynamic-batch-size --max-tokens-per-gpu 9216`, with or
without the package's `slime_fused` patch (MEGATRON_RL_PATCHES_SHARED_PREFIX from the environment).
Prints one JSON line: per data-parallel size, per rank its partition and micro-batches, and the
micro-batches' logical and physical tokens (the plan of each, as the training step builds it)."""
from __future__ import annotations

import json
import random
import sys
import types

from megatron_rl_patches.testing.service_stubs import SERVICES, install_service_stubs

install_service_stubs((*SERVICES, "sglang", "sglang_router"))

import torch  # noqa: E402

import megatron_rl_patches  # noqa: E402
from megatron_rl_patches.shared_prefix import plan_shared_prefix  # noqa: E402

PROMPT, RESPONSE, GROUP, GROUPS, BUDGET = 1024, 128, 8, 8, 9216


def physical(tokens: list[list[int]]) -> int:
    cu = [0]
    for one in tokens:
        cu.append(cu[-1] + len(one))
    return plan_shared_prefix(torch.tensor([t for one in tokens for t in one]), cu).stats.physical_tokens


def main(patched: bool) -> None:
    if patched:
        megatron_rl_patches.apply(only=["slime_fused"], strict=True)
    import slime.ray.rollout as rollout
    from slime.utils.types import Sample

    rollout.ray = types.SimpleNamespace(put=lambda value, **_: value)
    rng = random.Random(0)
    samples = []
    for group in range(GROUPS):
        prompt = [rng.randrange(1000, 50_000) for _ in range(PROMPT)]
        for member in range(GROUP):
            index = group * GROUP + member
            sample = Sample(index=index, tokens=prompt + [rng.randrange(1000, 50_000) for _ in range(RESPONSE)],
                            response_length=RESPONSE, reward=float(member), group_index=group)
            sample.rollout_id = index
            samples.append(sample)
    out = {"wrapped": [hasattr(rollout.build_dp_schedule, "__wrapped__")]}
    for dp in (1, 2):
        manager = object.__new__(rollout.RolloutManager)
        manager.args = types.SimpleNamespace(
            advantage_estimator="reinforce", rewards_normalization=False, reward_key=None, n_samples_per_prompt=GROUP,
            rollout_batch_size=GROUPS, micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=BUDGET,
            balance_data=False, balance_by_flops=False, global_batch_size=GROUPS * GROUP, rollout_top_p=1.0,
            rollout_data_transport="object-store")
        manager.custom_convert_samples_to_train_data_func = manager.custom_reward_post_process_func = None
        manager.set_train_parallel_config({"dp_size": dp, "cp_size": 1, "vpp_size": 1,
                                           "microbatch_group_size_per_vp_stage": 1})
        data = manager._convert_samples_to_train_data(samples)
        ranks = [box.inner for box in manager._split_train_data_by_dp(data)]
        out[f"dp{dp}"] = []
        for rank in ranks:
            partition = list(rank["partition"])
            batches = [[partition[i] for i in local] for local in rank["micro_batch_indices"]]
            out[f"dp{dp}"].append({
                "partition": partition, "micro_batches": batches, "num_microbatches": list(rank["num_microbatches"]),
                "logical": [sum(len(samples[i].tokens) for i in batch) for batch in batches],
                "physical": [physical([samples[i].tokens for i in batch]) for batch in batches]})
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1] == "patched")
