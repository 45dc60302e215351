"""Segments held across a step's micro-batches: what a shared segment hands the rows that continue it.

A step's plan (`step.plan_shared_prefix_step`) finds every segment the samples of two or more
micro-batches share. Such a segment is computed once per step: the first micro-batch that reads it
runs it in a **side pass** before its own rows (a forward of the model over the segment's rows alone,
without gradients), which keeps, per layer, what its continuations read — the keys and values each
core attention saw at the segment's rows (after RoPE, grouped heads kept grouped) — and the
decoder's output at its rows (the hidden states its logical rows are scored from). That is its
**held state** (`HeldStore`); every micro-batch of the step that reads the segment computes only
its own rows against it (`HeldRows`: a plan's rows, some held, the rest computed).

In training each held tensor is one leaf of every reader's graph, so its gradient sums what every
reader makes of it. The segment's own backward runs once, in the backward of the micro-batch that
reads it last (its *owner*): a `DeferredSegments` node at the owner's decoder input, which the
owner's backward reaches after every layer has added its part, recomputes the segments the owner
owns (a forward of their rows with gradients, against their own held ancestors as leaves) and
backpropagates the summed gradients of their held state through it. The parameters' gradients it
finds are returned as the node's own, so they join the owner's in one accumulation per parameter:
megatron-core's DDP sees one gradient-ready event per parameter, as without holding, and its
reduce (overlapped or not) starts after them. The step's last micro-batch always carries the node
(with nothing to recompute it passes zeros), so the events per parameter are the same in every step
whether or not that micro-batch owns a segment (megatron-core checks them against the first step's).

Memory: the held state (per held row, per attention layer, keys and values of this rank's heads;
the decoder's output) and, in training, its gradient, from the side pass to the owner's backward;
the segment's activations only while its recompute runs. Compute: a held segment's forward twice
(side pass and recompute), its backward once."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

SIDE, MAIN, RECOMPUTE = "side", "main", "recompute"  # the passes a step's plans run


@dataclass(frozen=True)
class HeldSegment:
    """A step segment (`segment`, its index in the step's tree) at virtual rows [start, end) of a plan."""

    segment: int
    start: int
    end: int


class HeldStore:
    """The held state of one step: per step segment, its tensors by (role, module) — leaves that
    take gradients where the step trains — and the model that computes them (bound at the step's
    first planned forward)."""

    def __init__(self) -> None:
        self.values: dict[int, dict[tuple[str, Any], torch.Tensor]] = {}
        self.model: Any = None
        self.training: bool | None = None
        self.runner: Any = None  # runs the model over a plan of segments (bound with the model)

    def bind(self, model: Any, training: bool) -> None:
        """The language model and whether the step trains: the same for every pass of a step."""
        if self.model is None:
            self.model, self.training = model, training
            return
        if model is not self.model:
            raise ValueError("shared prefix: a step's plans ran on two models; plan each model's step on its own")
        if training != self.training:
            raise ValueError("shared prefix: a step's micro-batches ran with and without gradients; plan the "
                             "training step and each forward-only pass on their own (plan_shared_prefix_step per pass)")

    def holds(self, segment: int) -> bool:
        return segment in self.values

    def put(self, segment: int, key: tuple[str, Any], value: torch.Tensor) -> None:
        """`value` held for `segment` (a leaf taking gradients where the step trains)."""
        kept = value.detach().clone()  # its own storage: never the pass's whole stream behind a view
        if self.training:
            kept.requires_grad_(True)
        self.values.setdefault(segment, {})[key] = kept

    def get(self, segment: int, key: tuple[str, Any]) -> torch.Tensor:
        try:
            return self.values[segment][key]
        except KeyError:
            raise ValueError(f"shared prefix: held segment {segment} has no {key[0]} for this module: the side pass "
                             "that computes it did not run first (run a step's micro-batches in order, each once)"
                             ) from None

    def items(self, segment: int) -> Iterator[tuple[tuple[str, Any], torch.Tensor]]:
        return iter(self.values.get(segment, {}).items())

    def release(self, segments: Any) -> None:
        for segment in segments:
            self.values.pop(segment, None)


@dataclass(eq=False)
class HeldRows:
    """What a plan of a step holds: its `held` segments' rows come from `store`, the model computes
    `computed` (virtual rows, ascending); `exports` are the segments this pass keeps for later
    readers. A main pass (`mode` MAIN) first runs its `side` plans (the held segments it reads first,
    a pass each unit, in order), and carries the `owned` plans (the held segments it reads last,
    recomputed in its backward, a unit at a time, the last unit first);
    `last`: the step's last micro-batch. `order` [V]: each virtual row's index in the held rows
    (in `held`'s order) followed by the computed rows."""

    store: HeldStore
    mode: str
    micro_batch: int
    held: tuple[HeldSegment, ...]
    exports: tuple[HeldSegment, ...]
    computed: torch.Tensor
    order: torch.Tensor
    side: tuple[Any, ...] = ()
    owned: tuple[Any, ...] = ()
    last: bool = False
    recomputed: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def held_rows(self) -> int:
        return sum(one.end - one.start for one in self.held)


def held_rows_of(plan: Any) -> HeldRows | None:
    """The held rows of a plan (None: it computes every row)."""
    held = getattr(plan, "held", None)
    return held if isinstance(held, HeldRows) else None


def exports_of(plan: Any) -> tuple:
    """The segments a side or recompute plan of a step keeps for their readers (none for another plan)."""
    held = held_rows_of(plan)
    return () if held is None else tuple(held.exports)


def computed(plan: Any, name: str, device: Any) -> torch.Tensor:
    """The plan's tensor `name` ("tokens", "positions") at the rows it computes, on `device` (kept)."""
    held = held_rows_of(plan)
    if held is None:
        return plan.on(device, name)
    return plan.cached(("held-computed", name, str(torch.device(device))),
                       lambda: getattr(plan, name).index_select(0, held.computed).to(device))


def whole_stream(plan: Any, rows: torch.Tensor, role: str, module: Any) -> torch.Tensor:
    """The plan's virtual stream (dim 0) of the tensors `module` made under `role`: its computed
    `rows` with the held segments' rows put back in place (the store's leaves, whose gradient sums
    every reader's); the segments this pass keeps are kept from it."""
    held = held_rows_of(plan)
    if held is None:
        return rows
    pieces = [held.store.get(one.segment, (role, module)).to(rows.dtype) for one in held.held]
    whole = rows if not pieces else torch.cat([*pieces, rows]).index_select(
        0, plan.cached(("held-order", str(rows.device)), lambda: held.order.to(rows.device)))
    for one in held.exports:
        keep_state(plan, one.segment, role, module, whole[one.start:one.end])
    return whole


def held_state(plan: Any, segment: int, role: str, module: Any) -> torch.Tensor:
    """What held step segment `segment` handed its continuation under `role` in `module` (a leaf)."""
    held = held_rows_of(plan)
    assert held is not None
    return held.store.get(segment, (role, module))


def keep_state(plan: Any, segment: int, role: str, module: Any, value: torch.Tensor) -> None:
    """`value` kept as what step segment `segment` hands its continuation under `role` in `module`
    (a side pass's for the readers; a recompute's, backpropagated with the gradient the readers gave)."""
    held = held_rows_of(plan)
    assert held is not None
    if held.mode == RECOMPUTE:
        held.recomputed.append((value, held.store.get(segment, (role, module))))
    else:
        held.store.put(segment, (role, module), value)


class DeferredSegments(torch.autograd.Function):
    """At a main pass's decoder input: identity forward; backward, once every layer has added its
    part to the held state's gradients, the owned segments recomputed and backpropagated (see the
    module), their parameters' gradients returned as this node's."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, held: HeldRows, recompute: Callable[[Any], Any],
                *params: torch.Tensor) -> torch.Tensor:
        ctx.held, ctx.recompute = held, recompute
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]
        ctx.params = params  # parameters: alive with the model anyway
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        held, params = ctx.held, ctx.params
        found: list[Any] = [None] * len(params)
        for owned in reversed(held.owned):  # a unit's descendants (later units) first: its held state's gradient whole
            more = owned_gradients(held.store, owned, params, ctx.recompute)
            found = [g if m is None else m if g is None else g.add_(m) for g, m in zip(found, more)]
        zeros = [g if g is not None else torch.zeros((), dtype=dtype, device=device).expand(shape)
                 for g, (shape, dtype, device) in zip(found, ctx.shapes)]
        return (grad, None, None, *zeros)


def owned_gradients(store: HeldStore, owned: Any, params: tuple[torch.Tensor, ...],
                    recompute: Callable[[Any], Any]) -> list[Any]:
    """The owned segments recomputed with gradients (`recompute(plan)` runs the model over `owned`,
    its held ancestors read from `store`, and returns its output, of no row) and backpropagated from
    their held state's summed gradients: the parameters' gradients (None where none reached one);
    each held ancestor's gradient added to its leaf's; the owned segments released. A pass with
    nothing to backpropagate (an empty pass agreed with ranks that have one) backpropagates zeros
    from its output, through every layer, so its collectives meet theirs."""
    held = held_rows_of(owned)
    assert held is not None and held.mode == RECOMPUTE
    held.recomputed.clear()
    with torch.enable_grad():
        output = recompute(owned)
    outputs, grads = [], []
    for part, leaf in held.recomputed:
        if leaf.grad is not None:
            outputs.append(part)
            grads.append(leaf.grad.to(part.dtype))
    held.recomputed.clear()
    if not outputs and isinstance(output, torch.Tensor) and output.requires_grad:
        outputs, grads = [output], [torch.zeros_like(output)]
    ancestors = [leaf for one in held.held for _, leaf in store.items(one.segment)]
    found: list[Any] = [None] * len(params)
    if outputs:
        answers = torch.autograd.grad(outputs, [*params, *ancestors], grads, allow_unused=True)
        found = list(answers[:len(params)])
        for leaf, answer in zip(ancestors, answers[len(params):]):
            if answer is not None:
                leaf.grad = answer if leaf.grad is None else leaf.grad + answer
    store.release(one.segment for one in held.exports)
    return found
