"""Recorded MoE experts as part of what makes two packed tokens alike (`plan_shared_prefix(...,
routed_experts=)`).

Under routing replay (megatron-core's `moe_enable_routing_replay`, a framework's own replay of the
rollout's routes) each packed token takes the experts its record names, not the ones its router
would pick. Two samples holding the same prefix share its rows only if their records agree there,
at every MoE layer: a token's hidden state at layer n reads the experts chosen at every earlier
layer for every earlier token of its sequence. A deterministic engine records the same routes for
the same prefix, but a rollout engine whose arithmetic depends on its batch may not. So a plan
given the records builds its trie on (id, every layer's experts) per token: the samples share
exactly the rows where ids and routes both agree, and where they part the rest of each is its own
(never a route taken from another sample). What the records cost the sharing is said once.

The router of a planned model checks the same thing when it routes (`moe_statistics`): a plan
built without the records, or from other records than the ones replayed, is refused by name there
rather than run with one sample's experts for another's token."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl_patches._log import warn_once


def _layer(index: int, value: Any, tokens: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"plan_shared_prefix: routed_experts[{index}] must be a tensor of expert indices, got "
                        f"{type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.device.type == "meta":
        raise ValueError(f"plan_shared_prefix: routed_experts[{index}] must hold integer expert indices on a real "
                         f"device, got {value.dtype} on {value.device}")
    if value.dim() < 1 or value.size(0) != tokens:
        raise ValueError(f"plan_shared_prefix: routed_experts[{index}] has shape {tuple(value.shape)}: its first "
                         f"dimension must be the {tokens} packed tokens (each layer's [tokens, topk], as "
                         "RouterReplay.set_replay_data takes them, or one [tokens, layers, topk] tensor)")
    value = value.detach().to("cpu", torch.int64)
    return value.flatten(start_dim=1) if value.dim() > 1 else value.unsqueeze(1)


def route_keys(ids: torch.Tensor, routes: Any) -> torch.Tensor:
    """[T] int64: one key per packed token, equal for two tokens exactly where their ids and every
    layer's recorded experts are. `routes`: one tensor [T, ...] or a sequence of them (one per MoE
    layer); the caller's tensors are read, never changed."""
    tokens = ids.numel()
    if isinstance(routes, torch.Tensor):
        layers = [_layer(0, routes, tokens)]
    elif isinstance(routes, Sequence) and not isinstance(routes, (str, bytes)):
        if not routes:
            raise ValueError("plan_shared_prefix: routed_experts is empty: pass each MoE layer's recorded experts, or "
                             "routed_experts=None where no experts are replayed")
        layers = [_layer(index, value, tokens) for index, value in enumerate(routes)]
    else:
        raise TypeError("plan_shared_prefix: routed_experts must be a tensor [tokens, ...] of expert indices or a "
                        f"sequence of them (one per MoE layer), got {type(routes).__name__}")
    if tokens == 0:
        return ids.clone()
    table = torch.cat([ids.reshape(tokens, 1), *layers], dim=1)
    return torch.unique(table, dim=0, return_inverse=True)[1].to(torch.int64)


def padding_alike(keys: torch.Tensor, ids: torch.Tensor, bounds: list[int], samples: int) -> bool:
    """Whether every padding sequence of one repeated id also holds one route (its rows may then be
    computed once: `repeated_padding_once`)."""
    edges = list(bounds[samples:])
    if not edges or edges[-1] < ids.numel():
        edges.append(ids.numel())
    for start, end in zip(edges, edges[1:]):
        if end > start and bool((ids[start:end] == ids[start]).all()) and not bool((keys[start:end] == keys[start])
                                                                                     .all()):
            return False
    return True


def say_what_routes_cost(by_ids: int, by_routes: int, differing: list[int]) -> None:
    """One warning, where the records part samples whose ids agree: how many rows more are computed."""
    if by_routes <= by_ids:
        return
    shown = ", ".join(map(str, differing[:8])) + (" ..." if len(differing) > 8 else "")
    warn_once(f"shared prefix: the recorded MoE routes differ where samples' ids agree (samples {shown}): those "
              f"samples share only the rows where their records agree too, {by_routes - by_ids} more rows "
              "computed than their ids alone would need (a rollout engine whose routing depends on its batch "
              "records different experts for one prefix)")


def _shared_rows(logical_rows: torch.Tensor, starts: list[int], ends: list[int]) -> list[int]:
    """Per sample, how many of its rows another sample's rows read too (the samples' rows only)."""
    physical = logical_rows[:ends[-1] if ends else 0]
    shared = torch.bincount(physical).index_select(0, physical) > 1
    return [int(shared[start:stop].sum()) for start, stop in zip(starts, ends)]


def diverging_samples(by_ids: torch.Tensor, by_routes: torch.Tensor, starts: list[int], ends: list[int]) -> list[int]:
    """The samples that share fewer rows by their records than by their ids (`by_ids`, `by_routes`:
    the two layouts' physical row per logical row)."""
    return [sample for sample, (ids, routes) in enumerate(zip(_shared_rows(by_ids, starts, ends),
                                                              _shared_rows(by_routes, starts, ends))) if routes < ids]
