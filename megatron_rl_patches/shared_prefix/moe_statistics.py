"""MoE routing statistics in training under a shared-prefix plan, as the same samples packed whole
count them: a prefix token counts once per sample that holds it.

megatron-core's `TopKRouter.routing` computes, besides each token's experts, statistics over the
micro-batch's tokens: the z-loss (mean of lse²), the load-balancing losses (`aux_loss`,
`seq_aux_loss`, `global_aux_loss`: router probabilities summed over tokens times tokens per
expert), the expert-bias token counts (`local_tokens_per_expert`, which `finalize_model_grads`
turns into the bias update) and, in training, Sinkhorn's balancing over the batch. On the plan's
physical stream a prefix row stands for G logical rows, so each statistic would count it once.

Here a planned router routes the *logical* rows: the router's logits (one row of E numbers per
token, the only per-token input of every statistic) are read at each logical row
(`plan.logical_rows`), megatron-core's own `routing` runs on them unchanged, so every statistic,
its gradient (summed back into the shared row by the gather) and the counts equal the packed
path's; each physical row then takes the probabilities and experts of a logical row that reads it
(identical logits route identically, Sinkhorn included: its scaling is per row and per expert).
Rows no logical row reads (the plan's padding to a multiple) take logical row 0's routing: their
outputs are read by nothing. The gather costs T × E numbers; it runs only in training with a
statistic on.

Routing replay (megatron-core's `moe_enable_routing_replay`, its RouterReplay recording or replaying
each packed token's experts) routes the logical rows the same way, in every pass: the records are
the packed path's rows, so the router records or replays exactly what it would packed whole, and
each physical row then takes a reader's experts. That is exact only where every logical row a
physical row stands for was replayed the same experts: checked at each MoE layer
(`records_agree`), a plan built without the records (or from other records) refused by name;
`plan_shared_prefix(..., routed_experts=)` builds one whose shared rows agree (`routes`). Held segments and
context parallelism are refused under replay.

How the router gets the plan: megatron-core calls it from the MoE layer with the hidden states
and a padding mask only. The transformer layer's call carries the plan (`packed_seq_params`), so
a pre-hook of the layer hands the call's params to the layer's own router for the duration of that
call (`layer_params`) and a hook that runs even when the call raises (`always_call`) takes them
back: the plan still comes from the call's own arguments and never outlives the call (no module
variable, nothing leaking into the next micro-batch or an unplanned call). Full activation
recompute reruns the layer's call, hooks included. A recompute of the MLP or MoE module alone
reruns the router outside the layer's call, so it is refused by name when a statistic is on.

Under sequence parallelism each rank holds a share of the physical rows, and the packed path's
rank r routes the r-th share of the logical rows (its statistics reduced over the group by
megatron-core itself). So a planned router gathers the shares' logits (T_physical × E numbers),
routes the r-th share of the logical rows with megatron-core's own `routing` (the same rows, the
same group reductions, the same z-loss share as the packed path's rank r), gathers the routed
shares back and hands each of its own physical rows the routing of a logical row that reads it.
Both gathers send their gradient back reduce-scattered, so each row's gradient is the sum of what
every rank made of it. Sinkhorn in training cannot be exact there: each rank balances its own
share of the rows, so the copies of a prefix token that land on different ranks route differently
in the packed path, where the plan computes the token once; it is refused by name.

Context parallelism is the same cut over the context-parallel group: the packed path's rank r routes
its own share of the logical rows (zigzag or contiguous, as the caller cut the ids; under sequence
parallelism too, its tensor-parallel rank's part of that share), so a planned router gathers every
rank's physical logits, routes this rank's logical rows (megatron-core reduces the counts and losses
over the tensor-and-context group as it does for the packed path), gathers the routed rows back and
reads them at its physical rows. Sinkhorn in training beside context parallelism is refused by name:
megatron-core's own context-parallel path balances each rank's share on its own, so no cut of the
rows equals the batch balanced whole."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.model.arguments import ArgumentsByName
from megatron_rl_patches.shared_prefix.context_parallel import (
    GatheredStream,
    Share,
    computed_count,
    gathered_logical_order,
    gathered_stream,
    module_share,
    taken,
)
from megatron_rl_patches.shared_prefix.held import MAIN, HeldRows, held_rows_of, whole_stream
from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan, physical_readers, shared_prefix_plan_of
from megatron_rl_patches.shared_prefix.prepared import Prepared

# megatron-core's MoELayer.forward(hidden_states) and its router take no packed_seq_params: the layer's call hands
# its params (holding the plan) to its own router under this attribute, and takes them back when the call ends
LAYER_PARAMS = "_megatron_rl_patches_shared_prefix_layer_params"
ROUTER_LOGITS = "router-logits"  # what a shared segment hands the readers' MoE statistics: its rows' logits


def layer_params(router: Any) -> Any:
    """The params of the layer call `router` runs in (None: no planned call, or none in progress)."""
    return getattr(router, LAYER_PARAMS, None)


def is_router(module: Any) -> bool:
    """megatron-core's top-k MoE router (TopKRouter and its kin)."""
    return hasattr(module, "routing") and hasattr(module, "topk") and hasattr(module, "routing_type")


def is_moe_layer(module: Any) -> bool:
    """A transformer layer whose MLP routes tokens (an MoE layer)."""
    return is_router(getattr(getattr(module, "mlp", None), "router", None))


def counts_statistics(router: Any) -> bool:
    """Whether `router` computes a statistic over the batch's tokens in training."""
    config = router.config
    if hasattr(router, "is_aux_loss_enabled"):
        balancing = router.is_aux_loss_enabled()
    else:  # megatron-core 0.13: one balancing type, one coefficient
        balancing = router.routing_type in ("aux_loss", "seq_aux_loss") and bool(config.moe_aux_loss_coeff)
    return bool(router.routing_type == "sinkhorn" or getattr(config, "moe_z_loss_coeff", None) or balancing
                or getattr(router, "enable_expert_bias", False))


# a framework's own routing replay (one that records or replays each packed token's experts inside megatron-core's
# top-k, not through its RouterReplay) says by these checks, registered from its integration, when a router replays
_REPLAY_CHECKS: list[Callable[[Any], bool]] = []


def register_replay_check(check: Callable[[Any], bool]) -> None:
    """Count `check(router)` among the ways a router records or replays its experts (once per check)."""
    if check not in _REPLAY_CHECKS:
        _REPLAY_CHECKS.append(check)


def replays(router: Any) -> bool:
    """Whether `router` records or replays its experts per packed token: megatron-core's routing
    replay (`moe_enable_routing_replay`) with an action set, or a registered framework's own. Such a
    router routes the plan's logical rows, as the packed path's (the records are the packed path's
    rows)."""
    replay = getattr(router, "router_replay", None)
    if replay is not None and getattr(replay, "router_replay_action", None) is not None:
        return True
    return any(check(router) for check in _REPLAY_CHECKS)


def records_agree(plan: SharedPrefixPlan, routing_map: torch.Tensor) -> None:
    """Refuse a plan that computes on one row two logical rows routed to different experts
    (`routing_map`: every logical row's, in order): a plan built without the replayed records, or
    from others (`plan_shared_prefix(..., routed_experts=)` shares only rows whose records agree)."""
    device = routing_map.device
    logical = plan.on(device, "logical_rows")
    first = physical_readers(plan, device).index_select(0, logical)
    differ = (routing_map.index_select(0, first) != routing_map).any(dim=-1)
    if bool(differ.any()):
        row = int(differ.nonzero()[0, 0])
        raise ValueError(f"shared prefix: the replayed MoE routes of packed rows {int(first[row])} and {row} differ, "
                         f"and the plan computes both on one row ({int(logical[row])}): build the plan from the "
                         "records the routers replay (plan_shared_prefix(..., routed_experts=...)), which shares "
                         "only the rows whose records agree")


def prepare_moe_layer(layer: Any) -> None:
    """Install the plan's context on `layer` (its call) and the logical routing on its router."""
    layer.register_forward_pre_hook(plan_for_the_call, with_kwargs=True)
    layer.register_forward_hook(end_of_the_call, always_call=True)
    router = layer.mlp.router
    if not isinstance(router, PlannedRouter):
        router.__class__ = planned_router_class(router.__class__)


def plan_for_the_call(layer: Any, args: tuple, kwargs: dict) -> None:
    params = ArgumentsByName.of_forward(layer, args, kwargs).get("packed_seq_params")
    plan = shared_prefix_plan_of(params)
    if plan is not None and layer.training and counts_statistics(layer.mlp.router):
        if getattr(layer, "recompute_mlp", False) or getattr(layer.mlp, "moe_layer_recompute", False):
            raise ValueError("shared prefix: MoE routing statistics in training with the MLP / MoE module "
                             "recomputed on its own (recompute_modules 'mlp' / 'moe') are not taken with a "
                             "shared-prefix plan; recompute whole layers (recompute_granularity='full') or none")
    setattr(layer.mlp.router, LAYER_PARAMS, params if plan is not None else None)


def end_of_the_call(layer: Any, args: tuple, output: Any) -> None:
    setattr(layer.mlp.router, LAYER_PARAMS, None)


def _sequence_shares(router: Any, plan: SharedPrefixPlan, rows: int) -> tuple[int, int, Any] | None:
    """(ranks, this rank, group) where `router` sees this rank's sequence-parallel share of the plan's
    stream; None where it sees the whole stream."""
    computed = computed_count(plan)
    if rows == computed:
        return None
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    count = parallel_state.get_tensor_model_parallel_world_size()
    if not getattr(router.config, "sequence_parallel", False) or count < 2 or rows * count != computed:
        raise ValueError(f"shared prefix: the router sees {rows} rows, the plan's stream {computed}: a "
                         "router's statistics are counted on the whole stream or on its sequence-parallel share")
    if router.routing_type == "sinkhorn":
        raise ValueError("shared prefix: Sinkhorn load balancing in training under sequence parallelism is not taken "
                         "with a shared-prefix plan (each rank balances its share of the rows on its own, so a prefix "
                         "token its samples hold on different ranks routes differently in each)")
    if plan.logical_length % count:
        raise ValueError(f"shared prefix: under sequence parallelism the packed micro-batch ({plan.logical_length} "
                         f"tokens) must split evenly over the {count} tensor-parallel ranks")
    return count, parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()


def _context_parallel_routing(cls: Any, router: Any, flat: torch.Tensor, plan: SharedPrefixPlan, share: Share,
                               group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`cls.routing` of this rank's logical rows (its context-parallel share, and of that its
    sequence-parallel share), every rank's physical logits gathered; read back at this rank's
    physical rows from every rank's routed logical rows."""
    if router.routing_type == "sinkhorn":
        raise ValueError("shared prefix: Sinkhorn load balancing in training beside context parallelism is not taken "
                         "with a shared-prefix plan (each rank balances its own share of the rows)")
    from megatron.core import tensor_parallel  # lazy: optional dependency megatron-core

    rows, held = flat.shape[0], share.physical.numel()
    count, rank, tp_group = 1, 0, None
    if rows != held:
        shares = _sequence_shares(router, plan, rows * share.size)  # this CP rank's share of the rows, over TP
        assert shares is not None
        count, rank, tp_group = shares
        if rows * count != held or share.logical.numel() % count:
            raise ValueError(f"shared prefix: the router sees {rows} rows, this context-parallel rank's share of the "
                             f"plan's stream {held}: its {share.logical.numel()} logical rows must split evenly over "
                             f"the {count} tensor-parallel ranks")
        flat = tensor_parallel.gather_from_sequence_parallel_region(flat, group=tp_group)
    whole = whole_stream(plan, gathered_stream(flat, plan, share, group), ROUTER_LOGITS, router)
    logical = taken(plan, share, "logical_rows", "logical", whole.device)
    part = logical.numel() // count
    probs, routing_map = cls.routing(router, whole.index_select(0, logical[rank * part:(rank + 1) * part]).unsqueeze(1))
    with torch.no_grad():  # gloo gathers no bool: the routing map as bytes
        routing_bytes = routing_map.to(torch.uint8)
    if count > 1:
        probs = tensor_parallel.gather_from_sequence_parallel_region(probs, group=tp_group)
        with torch.no_grad():
            routing_bytes = tensor_parallel.gather_from_sequence_parallel_region(routing_bytes, group=tp_group)
    every_probs = GatheredStream.apply(probs, group)
    with torch.no_grad():
        every_map = GatheredStream.apply(routing_bytes, group)
    physical = share.physical.to(probs.device)[rank * rows:(rank + 1) * rows]
    reader = gathered_logical_order(plan, share, probs.device).index_select(
        0, physical_readers(plan, probs.device).index_select(0, physical))
    return every_probs.index_select(0, reader), every_map.index_select(0, reader).bool()


def computed_readers(plan: SharedPrefixPlan, device: Any) -> torch.Tensor:
    """[rows the model computes]: a logical row that reads each (`physical_readers` at those rows; cached)."""
    held = held_rows_of(plan)
    if held is None:
        return physical_readers(plan, device)
    return plan.cached(("held-readers", str(torch.device(device))), lambda: physical_readers(plan, device)
                       .index_select(0, held.computed.to(device)))


def _refuse_held_sinkhorn(router: Any, held: HeldRows | None) -> None:
    if held is not None and router.routing_type == "sinkhorn":
        raise ValueError("shared prefix: Sinkhorn load balancing in training is not taken with segments held across "
                         "micro-batches (it balances each micro-batch's rows together); plan each micro-batch on its "
                         "own (plan_shared_prefix)")


def _held_rows_routed_alone(cls: Any, router: Any, logits: torch.Tensor, plan: SharedPrefixPlan, params: Any) -> Any:
    """A pass of a step that counts no statistics (a side pass, a recompute, evaluation): its rows
    routed per token (counting nothing: the readers count a held segment's rows, once per sample), the
    router logits of the segments it keeps kept for their readers' statistics (every rank's rows
    gathered: the whole stream)."""
    held = held_rows_of(plan)
    assert held is not None
    if held.exports:
        rows = logits.shape[0] * logits.shape[1]
        whole = logits.reshape(rows, logits.shape[-1])
        cp = module_share(router, plan, params)
        mine = computed_count(plan) if cp is None else int(cp[0].physical.numel())
        if rows != mine:
            from megatron.core import parallel_state, tensor_parallel  # lazy: optional dependency megatron-core

            whole = tensor_parallel.gather_from_sequence_parallel_region(
                whole, group=parallel_state.get_tensor_model_parallel_group())
        if cp is not None:
            whole = gathered_stream(whole, plan, *cp)
        whole_stream(plan, whole, ROUTER_LOGITS, router)
    counts = router.local_tokens_per_expert
    before = None if counts is None or held.mode == MAIN else counts.clone()
    out = cls.routing(router, logits)
    if before is not None:  # a recompute's rows are counted by their readers
        counts.copy_(before)
    return out


class PlannedRouter(Prepared):
    """The mark of a router whose class `planned_router_class` made."""


@functools.cache
def planned_router_class(cls: Any) -> type:
    """`cls` (a top-k router) routing a plan's logical rows in training when it counts statistics."""

    def routing(self: Any, logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        params = layer_params(self)
        plan = shared_prefix_plan_of(params)
        held = held_rows_of(plan)
        replaying = plan is not None and replays(self)
        if replaying and held is not None:
            raise ValueError("shared prefix: MoE routing replay is not taken with segments held across micro-batches "
                             "(the records are each micro-batch's packed rows); plan each micro-batch on its own "
                             "(plan_shared_prefix(..., routed_experts=...))")
        if plan is not None and held is not None and not (held.mode == MAIN and self.training
                                                           and counts_statistics(self)):
            return _held_rows_routed_alone(cls, self, logits, plan, params)
        if plan is None or not (replaying or (self.training and counts_statistics(self))):
            return cls.routing(self, logits, *args, **kwargs)
        if args or kwargs.get("padding_mask") is not None:
            raise ValueError("shared prefix: a padding mask is not taken with a shared-prefix plan")
        rows = logits.shape[0] * logits.shape[1]
        flat = logits.reshape(rows, logits.shape[-1])
        cp = module_share(self, plan, params)
        if cp is not None:
            if replaying:
                raise ValueError("shared prefix: MoE routing replay beside context parallelism is not taken with a "
                                 "shared-prefix plan; pack the micro-batch whole")
            return _context_parallel_routing(cls, self, flat, plan, *cp)
        _refuse_held_sinkhorn(self, held)
        shares = _sequence_shares(self, plan, rows)
        if shares is None:
            virtual = whole_stream(plan, flat, ROUTER_LOGITS, self)  # a step's held rows back in place
            logical = virtual.index_select(0, plan.on(flat.device, "logical_rows"))
            probs, routing_map = cls.routing(self, logical.unsqueeze(1))
            if replaying:
                records_agree(plan, routing_map)
            reader = computed_readers(plan, probs.device)
            return probs.index_select(0, reader), routing_map.index_select(0, reader)
        from megatron.core import tensor_parallel  # lazy: optional dependency megatron-core

        count, rank, group = shares
        whole = whole_stream(plan, tensor_parallel.gather_from_sequence_parallel_region(flat, group=group),
                             ROUTER_LOGITS, self)
        share = plan.logical_length // count
        mine = plan.on(flat.device, "logical_rows")[rank * share:(rank + 1) * share]
        probs, routing_map = cls.routing(self, whole.index_select(0, mine).unsqueeze(1))
        every_probs = tensor_parallel.gather_from_sequence_parallel_region(probs, group=group)
        with torch.no_grad():  # gloo gathers no bool: the routing map as bytes
            every_map = tensor_parallel.gather_from_sequence_parallel_region(routing_map.to(torch.uint8), group=group)
        if replaying:
            records_agree(plan, every_map)
        reader = computed_readers(plan, probs.device)[rank * rows:(rank + 1) * rows]
        return every_probs.index_select(0, reader), every_map.index_select(0, reader).bool()

    return type(f"SharedPrefix{cls.__name__}", (cls, PlannedRouter), {"routing": routing, "__module__": cls.__module__,
                                                                     "__doc__": cls.__doc__})
