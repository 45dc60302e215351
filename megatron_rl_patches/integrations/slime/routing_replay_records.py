"""slime's routing replay (--use-routing-replay, --use-rollout-routing-replay) as a sharing plan reads it.

slime replays routes with its own `RoutingReplay` (one per MoE layer, holding a record per
micro-batch), inside megatron-core's top-k, staged by the environment: `ENABLE_ROUTING_REPLAY=1` and
`ROUTING_REPLAY_STAGE` ("record" in the old log-prob pass without the rollout's routes,
"replay_forward" / "replay_backward" where it replays them, "fallthrough" where the router picks).
Its records are the packed micro-batch's rows, each rank's share of them under sequence parallelism
(`prepare_routed_experts_for_routing_replay`). So:

- a router routes the plan's packed rows while slime records or replays (`slime_replays`, registered
  with the plan's routers), as megatron-core's own replay does;
- the pass's door reads the next micro-batch's record of every layer (`next_records`: the record at
  each `RoutingReplay`'s `forward_index`, where slime will pop it), and the plan, gathered over the
  tensor-parallel group, shares only the rows whose records agree;
- context parallelism and pipeline stages pack whole, said once in slime's words (`replay_reasons`):
  each context-parallel rank replays its own cut of the rows, and each stage holds its own layers'
  records while every stage must build the same plan."""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.integrations.shared_prefix_doors.decision import Reason
from megatron_rl_patches.settings import slime_routing_replay_stage

RECORDING_OR_REPLAYING = ("record", "replay_forward", "replay_backward")
REPLAYING = ("replay_forward", "replay_backward")  # the stages at slime's get_batch where its records are read
DROP = "drop --use-rollout-routing-replay and --use-routing-replay"


def slime_replays(router: Any) -> bool:
    """Whether slime's routing replay records or replays the routers' experts now."""
    del router  # slime's stage is one for every router
    return slime_routing_replay_stage() in RECORDING_OR_REPLAYING


def next_records() -> list[torch.Tensor] | None | str:
    """This rank's records of the micro-batch slime's routers replay next (each MoE layer's
    [rows, topk]); None where slime replays nothing now; a str where a record cannot be read here
    (the micro-batch then packs whole)."""
    if slime_routing_replay_stage() not in REPLAYING:
        return None
    try:
        from slime.utils.routing_replay import RoutingReplay  # lazy: optional dependency slime (where it runs)
    except ImportError:
        return None
    records: list[torch.Tensor] = []
    for replay in RoutingReplay.all_routing_replays:
        index = int(getattr(replay, "forward_index", 0))
        held = getattr(replay, "top_indices_list", [])
        if index >= len(held):
            return "slime's routing replay holds no record of this micro-batch"
        record = held[index]
        if not isinstance(record, torch.Tensor):  # slime's lazily read records: read only when popped
            return "slime's routing replay reads this micro-batch's records only when its router pops them"
        records.append(record)
    return records or None


def replay_reasons(args: Any) -> tuple[Reason, ...]:
    """Why slime's routing replay packs a pass whole at its layout (empty: it shares)."""
    if not (getattr(args, "use_routing_replay", False) or getattr(args, "use_rollout_routing_replay", False)):
        return ()
    reasons = []
    if int(getattr(args, "context_parallel_size", 1) or 1) > 1:
        reasons.append(Reason("slime's routing replay beside context parallelism (each rank replays its own cut of "
                              "the rows, which the sharing plan does not read yet)",
                              f"--context-parallel-size 1, or {DROP}"))
    if int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        reasons.append(Reason("slime's routing replay under pipeline parallelism (each stage holds its own layers' "
                              "records, and every stage must build the same sharing plan)",
                              f"--pipeline-model-parallel-size 1, or {DROP}"))
    return tuple(reasons)
