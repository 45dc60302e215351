"""MoE routing replay under a shared-prefix plan (issue 121, item 4), on a real megatron-core MoE
GPTModel with `moe_enable_routing_replay` (its RouterReplay: megatron-core 0.16 on): the records of
another model (the rollout's routes, which the trainer's own router would not choose) replayed
packed whole and under a plan built with `routed_experts=`: log-probs, every gradient, the aux and z-losses
megatron-core logs and the expert-bias counts equal the packed path's; records that part two
samples on a shared prefix split the plan there, still exact, said once; a plan built without the
records refused by name at the first MoE layer; a plan recording records the packed rows."""
from __future__ import annotations

import logging

import pytest
import torch
from kit.moe_statistics import STATISTICS, constant_padding, statistics_pass, varying_padding
from kit.routing_replay import acting, fresh_routers, recorded, replay_module
from kit.shared_prefix import ordinary

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.compare import grad_error, relative_error

pytestmark = pytest.mark.megatron
TOL, GRAD_TOL = 1e-6, 2e-6
STATISTICS_ON = {**STATISTICS["aux-loss"], **STATISTICS["z-loss"], **STATISTICS["expert-bias"]}


def _model(seed: int):
    from megatron_rl_patches.testing.moe_gpt import tiny_moe_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    return build_packed_gpt(seq_length=512, seed=seed, config=tiny_moe_config(moe_enable_routing_replay=True,
                                                                              **STATISTICS_ON))


def _rollout_and_trainer(batch):
    """(the rollout model's records of `batch` packed whole, the trainer model, its routers only registered)."""
    replay_module()
    fresh_routers()
    rollout = _model(seed=11)
    rollout.eval()
    records = recorded(lambda: rollout(batch.tokens, batch.positions, None, packed_seq_params=batch.thd_params()))
    fresh_routers()
    return records, _model(seed=5)


def _planned(batch, records, **plan):
    def route(model, b):
        from megatron_rl_patches.shared_prefix import prepare_shared_prefix, shared_prefix_params

        prepare_shared_prefix(model)
        params = shared_prefix_params(b.plan(**plan) if records is None else b.plan(routed_experts=records, **plan))
        return model(b.tokens, None, None, packed_seq_params=params)
    return route


def _replayed(model, batch, records, route):
    with acting("replay_forward", records):
        return statistics_pass(model, batch, route)


def _agree(got: dict, want: dict) -> None:
    assert relative_error(got["log_probs"], want["log_probs"]) < TOL
    assert grad_error(got["grads"], want["grads"]) < GRAD_TOL
    assert sorted(got["losses"]) == sorted(want["losses"]) and want["losses"]
    for name, values in want["losses"].items():
        assert relative_error(got["losses"][name], values) < TOL, name
    assert want["counts"] and all(torch.equal(g, w) for g, w in zip(got["counts"], want["counts"]))
    assert all(torch.equal(g, w) for g, w in zip(got["bias"], want["bias"]))


@layouts.mark("moe")
def test_replayed_routes_under_a_plan_equal_the_packed_path(megatron_cpu, moe_router_on_cpu, caplog):
    from megatron_rl_patches._log import forget_warnings

    forget_warnings()
    batch = varying_padding(((30, (5, 9, 3)), (10, (4, 6))), (7,), paddings=(5, 4))
    records, model = _rollout_and_trainer(batch)
    want = _replayed(model, batch, records, ordinary)
    own = statistics_pass(model, batch, ordinary)  # the trainer's own routes: the records differ from them
    assert relative_error(own["log_probs"], want["log_probs"]) > 1e-3
    got = _replayed(model, batch, records, _planned(batch, records, pad_to=2))
    _agree(got, want)
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        plan = batch.plan(routed_experts=records, pad_to=2)
    assert not [r for r in caplog.records if "recorded MoE routes differ" in r.getMessage()]  # nothing to say
    assert plan.stats == batch.plan(pad_to=2).stats  # one engine's records of one prefix agree: nothing unshared
    assert plan.stats.physical_tokens < plan.stats.logical_tokens - 40


@layouts.mark("moe")
def test_a_forward_only_pass_replays_and_records_the_packed_rows(megatron_cpu, moe_router_on_cpu):
    batch = constant_padding(((30, (5, 9, 3)), (10, (4, 6))), (7,), padding=5)
    records, model = _rollout_and_trainer(batch)
    model.eval()
    with torch.no_grad():
        with acting("replay_forward", records):
            want = ordinary(model, batch)
        with acting("replay_forward", records):
            got = _planned(batch, records, repeated_padding_once=True)(model, batch)
        plan = batch.plan(routed_experts=records, repeated_padding_once=True)
        assert plan.stats.padding_rows == 1  # its records agree
    assert relative_error(got[0, batch.rows], want[0, batch.rows]) < TOL
    mine = recorded(lambda: ordinary(model, batch))
    planned_records = recorded(lambda: _planned(batch, records)(model, batch))
    assert len(mine) == 2 and all(torch.equal(a, b) for a, b in zip(planned_records, mine))


@layouts.mark("moe")
def test_records_that_part_two_samples_split_the_plan_there_and_stay_exact(megatron_cpu, moe_router_on_cpu, caplog):
    from megatron_rl_patches._log import forget_warnings

    batch = varying_padding(((30, (5, 9, 3)), (10, (4, 6))), (7,), paddings=(5, 4))
    records, model = _rollout_and_trainer(batch)
    start = int(batch.cu_seqlens[1])  # the second member of the first group: its 13th prompt token
    parted = [r.clone() for r in records]
    first = int(parted[1][start + 12, 0])
    parted[1][start + 12] = torch.tensor([(first + 1) % 4, (first + 2) % 4])  # another pair of the 4 experts
    kept = [r.clone() for r in parted]
    forget_warnings()
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        plan = batch.plan(routed_experts=parted, pad_to=2)
    said = [r.getMessage() for r in caplog.records if "recorded MoE routes differ" in r.getMessage()]
    assert len(said) == 1 and "(samples 1)" in said[0] and f"{30 - 12} more rows" in said[0], said
    assert plan.stats.physical_tokens == batch.plan(pad_to=2).stats.physical_tokens + 30 - 12
    want = _replayed(model, batch, parted, ordinary)
    got = _replayed(model, batch, parted, _planned(batch, parted, pad_to=2))
    _agree(got, want)
    assert all(torch.equal(a, b) for a, b in zip(parted, kept))  # the caller's records untouched
    with pytest.raises(ValueError, match=r"replayed MoE routes of packed rows \d+ and \d+ differ.*routed_experts="):
        _replayed(model, batch, parted, _planned(batch, None, pad_to=2))


@layouts.mark("moe")
def test_a_padding_run_whose_records_differ_is_computed_row_by_row(megatron_cpu, moe_router_on_cpu):
    batch = constant_padding(((30, (5, 9, 3)),), (7,), padding=5)
    records, model = _rollout_and_trainer(batch)
    parted = [r.clone() for r in records]
    parted[0][-2] = (parted[0][-2] + 1) % 4  # one padding row's record differs from its run's
    assert batch.plan(routed_experts=parted, repeated_padding_once=True).stats.padding_rows == 5
    want = _replayed(model, batch, parted, ordinary)
    got = _replayed(model, batch, parted, _planned(batch, parted, repeated_padding_once=True))
    _agree(got, want)


@pytest.mark.parametrize("routes, error, words", [
    (lambda t: [torch.zeros(t - 1, 2, dtype=torch.int64)], ValueError,
     r"first dimension must be the \d+ packed tokens \(each layer's \[tokens, topk\], as RouterReplay.set_replay_data "
     r"takes them, or one \[tokens, layers, topk\] tensor\)"),
    (lambda t: [torch.zeros(t, 2)], ValueError, "integer expert indices"),
    (lambda t: [torch.zeros(t, 2, dtype=torch.int64, device="meta")], ValueError, "integer expert indices on a real"),
    (lambda t: [torch.zeros(t, 2, dtype=torch.int64), [0] * t], TypeError,
     r"routed_experts\[1\] must be a tensor of expert indices, got list"),
    (lambda t: torch.zeros(t + 1, 2, dtype=torch.int64), ValueError, r"routed_experts\[0\] has shape \(\d+, 2\)"),
    (lambda t: [], ValueError, r"^plan_shared_prefix: routed_experts is empty: pass each MoE layer's recorded "
                               r"experts, or routed_experts=None where no experts are replayed$"),
    (lambda t: "experts", TypeError, r"^plan_shared_prefix: routed_experts must be a tensor \[tokens, \.\.\.\] of "
                                     r"expert indices or a sequence of them \(one per MoE layer\), got str$"),
])
def test_bad_routes_are_refused_by_name(routes, error, words):
    from kit.shared_prefix import grpo_batch

    batch = grpo_batch()
    tokens = batch.tokens.clone()
    given = routes(batch.tokens.numel())
    with pytest.raises(error, match=words):
        batch.plan(routed_experts=given)
    assert torch.equal(batch.tokens, tokens)


def test_routing_replay_holds_no_segment_across_micro_batches():
    from megatron_rl_patches.shared_prefix.held_refusals import config_held_reasons
    from megatron_rl_patches.testing.moe_gpt import tiny_moe_config

    replay_module()  # skips a megatron-core without the field (0.13)
    reasons = config_held_reasons(tiny_moe_config(moe_enable_routing_replay=True), training=False)
    assert len(reasons) == 1 and reasons[0].startswith("MoE routing replay (moe_enable_routing_replay)")
    assert config_held_reasons(tiny_moe_config(), training=False) == []


def _stream():
    """Three samples sharing 4 leading ids (one of them 2 ids longer), then 3 padding rows of id 0 past
    cu_seqlens[-1]: (ids, cu_seqlens)."""
    ids = torch.tensor([5, 6, 7, 8, 1, 5, 6, 7, 8, 2, 5, 6, 7, 8, 3, 4, 0, 0, 0])
    return ids, [0, 5, 10, 16]


def test_the_records_given_as_one_tensor_or_per_layer_plan_alike():
    from megatron_rl_patches.shared_prefix import plan_shared_prefix

    ids, cu = _stream()
    records = torch.arange(ids.numel() * 2 * 3).reshape(ids.numel(), 2, 3) % 1  # every row alike: nothing parts
    records[11, 1, 2] = 1  # sample 2's second token, layer 1: sample 2 parts from the others after one token
    whole = plan_shared_prefix(ids, cu, routed_experts=records)
    per_layer = plan_shared_prefix(ids, cu, routed_experts=[records[:, 0], records[:, 1]])
    top_1 = plan_shared_prefix(ids, cu, routed_experts=records[:, 1, 2])  # [T]: one layer, top-1
    assert whole.stats == per_layer.stats == top_1.stats
    assert torch.equal(whole.tokens, top_1.tokens) and torch.equal(whole.logical_rows, top_1.logical_rows)
    assert whole.stats.physical_tokens == plan_shared_prefix(ids, cu).stats.physical_tokens + 3


def test_padding_past_the_last_sequence_is_computed_once_only_where_its_records_agree():
    from megatron_rl_patches.shared_prefix import plan_shared_prefix

    ids, cu = _stream()
    records = torch.zeros(ids.numel(), 2, dtype=torch.int64)
    assert plan_shared_prefix(ids, cu, routed_experts=records, repeated_padding_once=True).stats.padding_rows == 1
    records[-1, 0] = 3
    assert plan_shared_prefix(ids, cu, routed_experts=records, repeated_padding_once=True).stats.padding_rows == 3
    assert plan_shared_prefix(ids, cu, routed_experts=records).stats.padding_rows == 3


@pytest.mark.parametrize("samples, named", [(8, "0, 1, 2, 3, 4, 5, 6, 7"), (9, "0, 1, 2, 3, 4, 5, 6, 7 ..."),
                                             (10, "0, 1, 2, 3, 4, 5, 6, 7 ...")])
def test_the_warning_names_at_most_eight_samples(caplog, samples, named):
    from megatron_rl_patches._log import forget_warnings
    from megatron_rl_patches.shared_prefix import plan_shared_prefix

    ids = torch.tensor([4, 5, 6] * samples)
    records = torch.zeros(3 * samples, 1, dtype=torch.int64)
    records[1::3, 0] = torch.arange(samples)  # each sample's second token its own expert: every sample parts after one
    forget_warnings()
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        plan = plan_shared_prefix(ids, list(range(0, 3 * samples + 1, 3)), routed_experts=records)
    said = [r.getMessage() for r in caplog.records if "recorded MoE routes differ" in r.getMessage()]
    assert said == [f"megatron-rl-patches: shared prefix: the recorded MoE routes differ where samples' ids agree "
                    f"(samples {named}): those samples share only the rows where their records agree too, "
                    f"{2 * samples - 2} more rows computed than their ids alone would need (a rollout engine whose "
                    "routing depends on its batch records different experts for one prefix)"], said
    assert plan.stats.physical_tokens == 1 + samples * 2


def test_an_empty_stream_or_one_of_padding_plans_alike_with_records():
    from megatron_rl_patches.shared_prefix import plan_shared_prefix

    empty = torch.zeros(0, dtype=torch.int64)
    assert plan_shared_prefix(empty, [0], routed_experts=torch.zeros(0, 2, dtype=torch.int64)).stats == \
        plan_shared_prefix(empty, [0]).stats
    padding = torch.full((3,), 7)
    records = torch.zeros(3, 2, dtype=torch.int64)
    assert plan_shared_prefix(padding, [0, 3], samples=0, routed_experts=records,
                              repeated_padding_once=True).stats.padding_rows == 1


def test_a_padding_sequence_of_no_rows_at_the_streams_end_is_read():
    from megatron_rl_patches.shared_prefix import plan_shared_prefix

    ids = torch.tensor([1, 2, 3, 1, 2, 4, 7, 7, 7, 7])
    records = torch.zeros(10, 1, dtype=torch.int64)
    plan = plan_shared_prefix(ids, [0, 3, 6, 10, 10], samples=2, routed_experts=records, repeated_padding_once=True)
    assert plan.stats.padding_rows == 1 and plan.stats.physical_tokens == 4
