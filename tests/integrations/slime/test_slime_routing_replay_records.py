"""slime's routing replay as the sharing plan reads it (`integrations/slime/routing_replay_records.py`):
the stage slime's environment names, the record of the micro-batch each `RoutingReplay` pops next,
and what cannot be read here. slime's `RoutingReplay` is stood in (slime runs in its lane:
tests/integrations/slime/lane/test_slime_routing_replay_lane.py replays through its real
`train_actor`); its fields are the ones slime 624b824a's class holds."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron_rl_patches.integrations.slime.routing_replay_records import next_records, slime_replays


class RoutingReplay:  # slime.utils.routing_replay.RoutingReplay's fields
    all_routing_replays: list = []

    def __init__(self, records: list) -> None:
        self.forward_index = 0
        self.backward_index = 0
        self.top_indices_list = records


class LazyRecord:  # slime's lazily read records: materialized when popped
    def materialize_for_routing_replay(self, stage: str) -> torch.Tensor:
        raise AssertionError("the plan never materializes a record")


@pytest.fixture
def slime_replay(monkeypatch):
    module = types.ModuleType("slime.utils.routing_replay")
    module.RoutingReplay = RoutingReplay
    for name, value in (("slime", types.ModuleType("slime")), ("slime.utils", types.ModuleType("slime.utils")),
                        ("slime.utils.routing_replay", module)):
        monkeypatch.setitem(sys.modules, name, value)
    layers = [RoutingReplay([torch.full((6, 2), layer * 10 + m) for m in range(3)]) for layer in range(2)]
    monkeypatch.setattr(RoutingReplay, "all_routing_replays", layers)
    monkeypatch.setenv("ENABLE_ROUTING_REPLAY", "1")
    return layers


@pytest.mark.parametrize("stage", ["replay_forward", "replay_backward"])
def test_the_records_slime_pops_next_are_read_at_each_layer(slime_replay, monkeypatch, stage):
    monkeypatch.setenv("ROUTING_REPLAY_STAGE", stage)
    records = next_records()
    assert [int(r[0, 0]) for r in records] == [0, 10]
    for replay in slime_replay:
        replay.forward_index = 2
    assert [int(r[0, 0]) for r in next_records()] == [2, 12]
    assert all(r.forward_index == 2 and len(r.top_indices_list) == 3 for r in slime_replay)  # nothing popped
    assert slime_replays(None)


@pytest.mark.parametrize("stage, replays", [("record", True), ("fallthrough", False), (None, False)])
def test_no_records_where_slime_records_or_its_router_picks(slime_replay, monkeypatch, stage, replays):
    if stage is None:
        monkeypatch.delenv("ROUTING_REPLAY_STAGE", raising=False)
    else:
        monkeypatch.setenv("ROUTING_REPLAY_STAGE", stage)
    assert next_records() is None
    assert slime_replays(None) is replays


def test_replay_off_reads_nothing(slime_replay, monkeypatch):
    monkeypatch.setenv("ROUTING_REPLAY_STAGE", "replay_forward")
    monkeypatch.setenv("ENABLE_ROUTING_REPLAY", "0")
    assert next_records() is None and not slime_replays(None)


def test_a_record_slime_reads_lazily_or_does_not_hold_is_said(slime_replay, monkeypatch):
    monkeypatch.setenv("ROUTING_REPLAY_STAGE", "replay_forward")
    slime_replay[1].top_indices_list[0] = LazyRecord()
    assert next_records() == ("slime's routing replay reads this micro-batch's records only when its router pops "
                              "them")
    for replay in slime_replay:
        replay.forward_index = 3
    assert next_records() == "slime's routing replay holds no record of this micro-batch"


def test_without_slime_nothing_is_read(monkeypatch):
    monkeypatch.setenv("ENABLE_ROUTING_REPLAY", "1")
    monkeypatch.setenv("ROUTING_REPLAY_STAGE", "replay_forward")
    monkeypatch.setitem(sys.modules, "slime.utils.routing_replay", None)  # not importable
    assert next_records() is None


def test_why_slimes_replay_packs_whole_at_each_layout():
    from types import SimpleNamespace as Args

    from megatron_rl_patches.integrations.shared_prefix_doors.decision import Reason
    from megatron_rl_patches.integrations.slime.routing_replay_records import replay_reasons

    drop = "drop --use-rollout-routing-replay and --use-routing-replay"
    context = Reason("slime's routing replay beside context parallelism (each rank replays its own cut of the rows, "
                     "which the sharing plan does not read yet)", f"--context-parallel-size 1, or {drop}")
    stages = Reason("slime's routing replay under pipeline parallelism (each stage holds its own layers' records, "
                    "and every stage must build the same sharing plan)", f"--pipeline-model-parallel-size 1, or {drop}")
    assert replay_reasons(Args(context_parallel_size=2, pipeline_model_parallel_size=2)) == ()  # no replay
    assert replay_reasons(Args(use_rollout_routing_replay=True, context_parallel_size=2)) == (context,)
    assert replay_reasons(Args(use_routing_replay=True, pipeline_model_parallel_size=2)) == (stages,)
    assert replay_reasons(Args(use_routing_replay=True, context_parallel_size=2,
                               pipeline_model_parallel_size=2)) == (context, stages)
    assert replay_reasons(Args(use_routing_replay=True, context_parallel_size=None,
                               pipeline_model_parallel_size=0)) == ()  # unset sizes: one rank
