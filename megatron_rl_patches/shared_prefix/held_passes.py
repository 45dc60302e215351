"""The passes of a step's held segments around a micro-batch's own forward (see `held`): the side
pass before it (the segments it reads first, computed without gradients and kept), the deferred node
at its decoder input (in training: the segments it reads last, recomputed and backpropagated in its
backward) and the held state released after its last forward-only reader.

`run` (given by the model's seams) runs the model over a plan of segments alone: a forward whose
logical rows are none, so nothing past the decoder is computed. Those passes run the model in
evaluation mode: their rows' statistics (MoE losses and counts) are the readers' to count, and
megatron-core's activation recompute (training only) would keep their graph from the recompute's
gradients; the arithmetic is the training forward's (a plan refuses dropout).

The step's last micro-batch carries the deferred node even with nothing to recompute (zeros for
every parameter): megatron-core's DDP with overlap-grad-reduce counts each parameter's gradient-ready
events in the step's last micro-batch against the first step's, and under full activation
recompute the node's gradients are one more event per parameter."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_rl_patches.model.arguments import ArgumentsByName
from megatron_rl_patches.shared_prefix.held import MAIN, DeferredSegments, exports_of, held_rows_of
from megatron_rl_patches.shared_prefix.plan import shared_prefix_plan_of

Run = Callable[[Any, Any, Any], Any]  # (language model, plan of segments, the main pass's params) -> its output


@contextmanager
def evaluating(model: Any) -> Iterator[None]:
    """`model` in evaluation mode inside, each module's own mode restored after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def alone(run: Run, model: Any, params: Any) -> Callable[[Any], Any]:
    """`run` of a plan of segments on `model` (with the pass's `params`), in evaluation mode."""
    def run_alone(segments: Any) -> Any:
        with evaluating(model):
            return run(model, segments, params)

    return run_alone


def begin_held_pass(model: Any, plan: Any, params: Any, run: Run) -> None:
    """At a pass's language-model input: a main pass binds the step's store to `model` and first runs
    its side pass (once: a recompute of the layer stack reruns the pass's call without it)."""
    held = held_rows_of(plan)
    if held is None or held.mode != MAIN:
        return
    store = held.store
    store.bind(model, torch.is_grad_enabled())
    store.runner = alone(run, model, params)
    for side in held.side:  # each unit once: a recompute of the layer stack reruns this call
        if not all(store.holds(one.segment) for one in exports_of(side)):
            with torch.no_grad():
                store.runner(side)


def deferred_at_input(decoder: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the decoder: in a training main pass that owns held segments, or is the
    step's last, its input through `DeferredSegments` (the owned segments' backward in this pass's)."""
    call = ArgumentsByName.of_forward(decoder, args, kwargs)
    held = held_rows_of(shared_prefix_plan_of(call.get("packed_seq_params")))
    if held is None or held.mode != MAIN or not held.store.training or not (held.owned or held.last):
        return None
    hidden = call.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise ValueError("shared prefix: a step's held segments need the decoder's input hidden states (the first "
                         "pipeline stage's embedding output); run them without pipeline parallelism")
    weights = [p for p in held.store.model.parameters() if p.requires_grad]
    call.set("hidden_states", DeferredSegments.apply(hidden, held, held.store.runner, *weights))
    return call.done()


def end_held_pass(plan: Any) -> None:
    """After a forward-only main pass's decoder: the held segments it read last released."""
    held = held_rows_of(plan)
    if held is None or held.mode != MAIN or held.store.training:
        return
    for owned in held.owned:
        held.store.release(one.segment for one in exports_of(owned))
