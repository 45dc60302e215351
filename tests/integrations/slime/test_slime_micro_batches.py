"""slime's dynamic micro-batches in physical tokens (issue 111 item 7), door by door without slime
(the slime lane runs slime's real rollout manager and schedule: lane/test_slime_micro_batches_lane.py):
the split hands slime's schedule rollout ids holding the rollout's tokens only with shared-prefix
packing on, the schedule hands on lengths that know their samples' tokens, and the first fit packs
those as the model computes them (a group whole where it fits, a sample past the budget alone, as
slime places it); everything else goes to slime as given."""
from __future__ import annotations

import functools
import random
import types

import pytest

from megatron_rl_patches.integrations.slime import micro_batches as doors
from megatron_rl_patches.integrations.slime.patches import PATCHES

SHARED = "MEGATRON_RL_PATCHES_SHARED_PREFIX"


@pytest.fixture(autouse=True)
def _slime(slime_standin):
    return slime_standin


def lengths_first_fit(total_lengths, max_tokens_per_bin):
    """slime's first fit by whole lengths, in order (the stand-in's, which behaves as slime's)."""
    from slime.utils.dp_schedule import first_fit_pack

    return first_fit_pack(total_lengths, max_tokens_per_bin)


def schedule(args, train_parallel_config, total_lengths, *, global_batch_size, rollout_indices):
    """A one-step schedule as slime's calls its first fit: the step's lengths, the budget per bin."""
    step = [total_lengths[i] for i in range(len(total_lengths))]
    return doors.first_fit_wrapper(lengths_first_fit, None, (step, args.max_tokens_per_gpu), {})


def split(manager, data):
    """The rollout manager's split: lengths from the tokens, then the schedule (its rollout ids, slime's)."""
    lengths = [len(t) for t in data["tokens"]]
    return doors.schedule_wrapper(schedule, None, (manager.args, {}, lengths),
                                  {"global_batch_size": 1, "rollout_indices": data["rollout_ids"]})


def grpo(groups=8, group=8, prompt=1024, response=128, seed=0):
    rng = random.Random(seed)
    tokens = []
    for _ in range(groups):
        shared = [rng.randrange(1000, 50_000) for _ in range(prompt)]
        tokens += [shared + [rng.randrange(1000, 50_000) for _ in range(response)] for _ in range(group)]
    return tokens


PER_MICRO_BATCH = {"pipeline_model_parallel_size": 2}  # a step that cannot hold segments: each micro-batch planned


def run_split(monkeypatch, switch, tokens, budget=9216, **args):
    monkeypatch.setenv(SHARED, switch)
    manager = types.SimpleNamespace(args=types.SimpleNamespace(max_tokens_per_gpu=budget, **args))
    bound = functools.partial(split, manager)  # as wrapt hands a method
    data = {"tokens": tokens, "rollout_ids": list(range(len(tokens)))}
    batches = doors.split_wrapper(bound, manager, (data,), {})
    assert type(data["rollout_ids"]) is list and data["tokens"] is tokens  # the caller's data as it was
    return batches


def test_eight_groups_take_two_micro_batches_with_sharing_on_and_eight_off(monkeypatch):
    tokens = grpo()
    off = run_split(monkeypatch, "0", tokens)
    assert off == lengths_first_fit([len(t) for t in tokens], 9216) and len(off) == 8
    on = run_split(monkeypatch, "1", tokens, **PER_MICRO_BATCH)
    assert on == [list(range(32)), list(range(32, 64))]  # four groups whole in each: 4 * (1,024 + 8 * 128) tokens


def test_a_group_past_the_budget_is_cut_and_a_sample_past_it_alone(monkeypatch):
    tokens = grpo(groups=1, group=8, prompt=100, response=20) + [list(range(5000, 5400))]
    batches = run_split(monkeypatch, "1", tokens, budget=200, **PER_MICRO_BATCH)  # the group: 100 + 8 * 20 = 260
    assert sorted(i for b in batches for i in b) == list(range(9))
    assert [8] in batches  # 400 tokens, past 200: alone, as slime places it
    assert all(len(b) <= 5 for b in batches if b != [8])  # 100 + 5 * 20 = 200 at most


def test_where_the_step_holds_segments_a_cut_group_lies_in_consecutive_micro_batches_counted_once(monkeypatch):
    """A model whose steps hold segments (slime's arguments: no pipeline stages, no dropout, ...): the
    first fit cuts next-fit in the samples' trie order (issue 120), each prompt counted once per step
    and its held rows at `step_held_cost`; a step that cannot hold keeps the first fit above."""
    from megatron_rl_patches.integrations.megatron.shared_prefix_step_pass import step_held_cost
    from megatron_rl_patches.shared_prefix import shared_prefix_micro_batches

    tokens = grpo(groups=3, group=8, prompt=100, response=20)  # each group 100 + 8 * 20 = 260 tokens
    model = {"hidden_size": 64, "num_attention_heads": 4, "group_query_attention": True, "num_query_groups": 1}
    held_cost = step_held_cost(types.SimpleNamespace(**model))
    assert held_cost == 4 * 16 / (17 * 64)  # keys, values and their gradients of one group of 16 wide heads
    batches = run_split(monkeypatch, "1", tokens, budget=200, **model)
    assert batches == shared_prefix_micro_batches(tokens, 200, held_cost=held_cost)
    assert sorted(i for b in batches for i in b) == list(range(24))
    assert batches != run_split(monkeypatch, "1", tokens, budget=200, **model, **PER_MICRO_BATCH)
    for group in range(3):  # each group's parts side by side
        holding = [k for k, b in enumerate(batches) if any(i // 8 == group for i in b)]
        assert holding == list(range(holding[0], holding[-1] + 1))
    for refused in ({"hidden_dropout": 0.1}, {"context_parallel_size": 2}, {"mtp_num_layers": 1},
                    {"num_experts": 4, "moe_router_load_balancing_type": "sinkhorn"}):
        assert step_held_cost(types.SimpleNamespace(**model, **refused)) is None, refused


def test_lengths_that_know_no_sample_and_calls_outside_a_split_go_to_slime_as_given():
    assert doors.first_fit_wrapper(lengths_first_fit, None, ([5, 5, 5], 10), {}) == [[0, 1], [2]]
    counted = [doors.SampleLength(5, 0), doors.SampleLength(7, 1)]
    assert doors.first_fit_wrapper(lengths_first_fit, None, (counted, 10), {}) == [[0], [1]]  # no split: no tokens
    assert counted[1] == 7 and sum(counted) == 12 and counted[1].index == 1
    seen = []
    doors.schedule_wrapper(lambda *a, **k: seen.append(a[2]), None, (None, {}, [3, 4]), {})
    assert seen == [[3, 4]] and not isinstance(seen[0][0], doors.SampleLength)


def test_the_three_doors_are_slime_fused_records_of_slimes_names():
    records = {p.target: p for p in PATCHES if p.wrapper.startswith(f"{doors.__name__}:")}
    assert set(records) == {"slime.ray.rollout:RolloutManager._split_train_data_by_dp",
                            "slime.ray.rollout:build_dp_schedule", "slime.utils.dp_schedule:first_fit_pack"}
    assert {p.name for p in records.values()} == {"slime_fused"} and all(p.optional for p in records.values())
    assert records["slime.utils.dp_schedule:first_fit_pack"].params == ("total_lengths", "max_tokens_per_bin")
