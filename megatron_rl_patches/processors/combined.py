"""Output processors run together in one model call, each reading the same hidden states and the
same output layer: the log-prob processor's dict plus the top-k buckets (`with_topk`, one row
selection for the ops) or plus a per-token divergence from teachers' hidden states
(`with_divergence`), and a teacher's pass that hands back its final hidden states and a copy of
its output weight's shard (`hidden_pass_processor`). Framework-free; slime's fused route
(`integrations.slime.fused`, `integrations.megatron.opd.fused_context`) builds them per micro-batch."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.processors.distill import hidden_output_processor
from megatron_rl_patches.processors.heads import one_row_selection, output_layer_pre_hooks_ran, topk_output_processor


def with_topk(log_prob: Callable, k: int | None, options: dict, topk_context: dict, union: bool = False) -> Callable:
    """The log-prob processor's dict plus "topk_log_probs" [b, s, k] and "tail" [b, s] (and
    "topk_ids" when `k` selects them, "ids_mask" with `union`); both read the same hidden states
    and the same row mask."""
    topk = topk_output_processor(k=k, union=union, **options)

    def process(*, output_layer: Any, context: dict | None = None, **kwargs: Any) -> dict:
        with one_row_selection():  # one host sync and one tensor-parallel check for the three ops
            result = dict(log_prob(output_layer=output_layer, context=context, **kwargs))
            with output_layer_pre_hooks_ran(output_layer):  # the log-prob call ran them for this forward
                shared = {key: value for key, value in (context or {}).items() if not key.startswith("kept_")}
                result.update(topk(output_layer=output_layer, context={**shared, **topk_context}, **kwargs))
        return result

    return process


def with_divergence(log_prob: Callable, divergence: Callable, key: str, divergence_context: dict) -> Callable:
    """The log-prob processor's dict plus the `divergence` processor's per-token values under `key`
    (its own context: the teachers' hidden states and weights, its row mask)."""

    def process(*, output_layer: Any, context: dict | None = None, **kwargs: Any) -> dict:
        result = dict(log_prob(output_layer=output_layer, context=context, **kwargs))
        with output_layer_pre_hooks_ran(output_layer):  # the log-prob call ran them for this forward
            result[key] = divergence(output_layer=output_layer, context=divergence_context, **kwargs)
        return result

    return process


def hidden_pass_processor(captured: list) -> Callable:
    """A teacher's pass: its final hidden states [1, T, H] (every rank's rows under sequence
    parallelism) and, once per pass, a copy of its output weight's shard (a snapshot's weights
    leave the actor after its pass) appended to `captured`. "log_probs" holds zeros: no log-prob
    is computed (a caller reads its device)."""
    hidden = hidden_output_processor()

    def process(*, hidden_states: Any, output_layer: Any, output_weight: Any = None, config: Any = None,
                **_: Any) -> dict:
        states = hidden(hidden_states=hidden_states, output_layer=output_layer, config=config)
        if not captured:  # the output weight: the tied embedding's where GPTModel hands it
            weight = output_layer.weight if output_weight is None else output_weight
            captured.append(weight.detach().clone())
        return {"teacher_hidden": states, "log_probs": torch.zeros(states.shape[:2], device=states.device)}

    return process
