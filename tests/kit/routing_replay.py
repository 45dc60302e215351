"""megatron-core's routing replay (`moe_enable_routing_replay`, its RouterReplay) as a test drives it:
record each MoE layer's experts from a forward (the rollout's records), then replay them in a pass,
each on the routers of the model built last (RouterReplay keeps one process-wide list)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch


def replay_module() -> Any:
    try:
        from megatron.core.transformer.moe import router_replay
    except ImportError:
        pytest.skip("this megatron-core has no routing replay (moe_enable_routing_replay: 0.16 on)")
    return router_replay


def fresh_routers() -> None:
    """Forget every router registered so far: the next model built is the one replayed."""
    replay_module().RouterReplay.clear_global_router_replay_instances()


@contextlib.contextmanager
def acting(action: str, records: list[torch.Tensor] | None = None) -> Iterator[None]:
    """Every router `action` ("record", "replay_forward") for the block; `records` replayed."""
    module = replay_module()
    replay = module.RouterReplay
    if records is not None:
        replay.set_replay_data(records)
    replay.set_global_router_replay_action(module.RouterReplayAction(action))
    try:
        yield
    finally:
        replay.clear_global_router_replay_action()
        replay.clear_global_indices()


def recorded(forward: Any) -> list[torch.Tensor]:
    """Each MoE layer's experts [tokens, topk] as `forward()` (no gradient) routes them."""
    with acting("record"), torch.no_grad():
        forward()
        return [indices.clone() for indices in replay_module().RouterReplay.get_recorded_data()]
