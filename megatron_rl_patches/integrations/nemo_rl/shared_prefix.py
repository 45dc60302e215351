"""`nemo_rl_shared_prefix`: NeMo-RL's Megatron passes compute a group's shared leading tokens once
(MEGATRON_RL_PATCHES_SHARED_PREFIX=1; docs/shared-prefix.md).

NeMo-RL 7ea279ab packs each micro-batch as one `thd` row (`nemo_rl/models/megatron/data.py`) and
every pass of its Megatron policy runs `megatron_forward_backward` (train.py): the training step
(`LossPostProcessor`), the policy's and the reference's log-probs (`LogprobsPostProcessor`) and a
distillation teacher's top-k (`TopkLogitsPostProcessor`: NeMo-RL's teacher Policy, and the
package's self-teacher and privileged teacher, which call it). Two wrappers:

- the pass's door (`forward_backward_wrapper`, on `megatron_forward_backward`): whether the pass runs
  planned (the setting, what NeMo-RL's call asks, then what the model can run, agreed over every
  rank before the first collective: `prefix_pass`), the pass's figures logged when it ends; the
  pass travels with the data iterator (`carrying`) to
- the forward step (`forward_step_wrapper`, on `forward_with_post_processing_fn`): the model called
  with the plan of the micro-batch's packed ids as its `packed_seq_params` (`PlannedModel`). The
  post-processor keeps NeMo-RL's own `packed_seq_params`: the model's output comes back in the rows
  of the packed micro-batch, so NeMo-RL's losses, log-prob and top-k gathers (or the fused route's
  processors) read the rows they read without the plan."""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.megatron.shared_prefix_pass import PrefixPass, logged, prefix_pass
from megatron_rl_patches.integrations.megatron.step_iterators import StepIterator, carried
from megatron_rl_patches.integrations.shared_prefix_doors.frameworks import NEMO_RL
from megatron_rl_patches.integrations.shared_prefix_doors.table import Layout
from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.settings import shared_prefix

PATCH = "nemo_rl_shared_prefix"
WHOLE = "shared prefix: {what}: a micro-batch not packed as one thd row ({reason}) runs whole"


class PassIterator(StepIterator):
    """NeMo-RL's micro-batch iterator carrying the pass's `PrefixPass` (`step`), iterable as NeMo-RL's
    forward step (and the fused records' `NotingIterator`) take it."""

    def __iter__(self) -> PassIterator:
        return self

    def __next__(self) -> Any:
        return next(self.iterator)


def carried_pass(iterator: Any) -> PrefixPass | None:
    """The `PrefixPass` an iterator carries, looking through the fused records' `NotingIterator`
    (`source`), which a record applied after this one wraps around it."""
    while iterator is not None:
        found = carried(iterator)
        if isinstance(found, PrefixPass):
            return found
        iterator = getattr(iterator, "source", None)
    return None


def pass_name(post_processing_fn: Any, forward_only: bool) -> str:
    """The pass's name in its log lines, from NeMo-RL's post-processor."""
    kind = type(post_processing_fn).__name__
    if kind == "LossPostProcessor":
        return "NeMo-RL's training step" if not forward_only else "NeMo-RL's loss pass (forward only)"
    if kind == "LogprobsPostProcessor":
        return "NeMo-RL's log-prob pass (the policy's or the reference's)"
    if kind == "TopkLogitsPostProcessor":
        return "NeMo-RL's top-k pass (a distillation teacher's)"
    return f"NeMo-RL's pass ({kind})"


def call_layout(arguments: dict, pipeline: int, mtp: bool = False) -> Layout:
    """What of NeMo-RL's call the shared-prefix table reads (each an argument of `megatron_forward_backward`
    or a parallel size, the same on every rank): sequence packing, router replay, a draft model's
    hidden-state capture, NeMo-RL's own fused head, pipeline stages (NeMo-RL pads every packed
    micro-batch to one length for them: `pipeline`, the pipeline-parallel size) and MTP layers (`mtp`)."""
    cfg: Any = getattr(arguments.get("post_processing_fn"), "cfg", None)
    packing: Any = cfg.get("sequence_packing", {}) if hasattr(cfg, "get") else {}
    return Layout(packed=bool(packing.get("enabled", False)), routing_replay=bool(arguments.get("use_router_replay")),
                  draft_capture=(arguments.get("draft_model") is not None
                                 or bool(arguments.get("enable_hidden_capture"))),
                  own_fused_head=bool(arguments.get("use_fused_linear_logprobs")),
                  fixed_lengths=pipeline > 1, mtp_training=mtp)


def forward_backward_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for NeMo-RL's `megatron_forward_backward(model, data_iterator, ...,
    post_processing_fn, forward_only, ...)`: the pass's door (every rank calls it before the pass's
    first collective). Under context parallelism each micro-batch is planned whole (NeMo-RL keeps the
    packed micro-batch beside each rank's zigzag share: `PlannedModel`)."""
    if not shared_prefix():
        return wrapped(*args, **kwargs)
    bound = bind(wrapped, args, kwargs)
    if bound is None:
        return wrapped(*args, **kwargs)
    arguments = bound.arguments
    forward_only = bool(arguments.get("forward_only", False))
    what = pass_name(arguments.get("post_processing_fn"), forward_only)
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    layout = call_layout(arguments, parallel_state.get_pipeline_model_parallel_world_size(),
                         mtp=has_mtp(arguments["model"]))
    prefix = prefix_pass(what, arguments["model"], training=not forward_only, enabled=True, cut_layout="zigzag",
                         framework=NEMO_RL, layout=layout)
    if prefix is None:
        return wrapped(*args, **kwargs)
    arguments["data_iterator"] = PassIterator(arguments["data_iterator"], prefix)
    with logged(prefix):
        return wrapped(*bound.args, **bound.kwargs)


def has_mtp(model: Any) -> bool:
    """Whether NeMo-RL's model (a chunk or a list of them, wrapped or not) has MTP layers."""
    from megatron.core.utils import get_model_config  # lazy: optional dependency megatron-core

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return any(int(getattr(get_model_config(chunk), "mtp_num_layers", None) or 0) > 0 for chunk in chunks)


class PlannedModel:
    """The forward step's model, called with the plan of each micro-batch's packed ids as its
    `packed_seq_params`; every attribute is the model's."""

    def __init__(self, model: Any, prefix: PrefixPass) -> None:
        self.model, self.prefix = model, prefix
        self.whole: Any = None  # the packed micro-batch [1, T] the forward step took (`NotedBatches`)

    def __getattr__(self, name: str) -> Any:
        if name in ("model", "prefix", "whole"):
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        packed: Any = kwargs.get("packed_seq_params")
        ids: Any = kwargs.get("input_ids")
        reason = whole_row_reason(ids, packed)
        if reason is not None:
            warn_once(WHOLE.format(what=self.prefix.what, reason=reason))
            return self.model(*args, **kwargs)
        samples = int(packed.cu_seqlens_q.numel()) - 1  # NeMo-RL pads inside the last sample's rows
        whole = None
        if self.prefix.cut is not None and isinstance(self.whole, torch.Tensor) and self.whole.dim() == 2:
            whole = self.whole[0]  # under context parallelism: the packed micro-batch, this rank's share cut from it
        kwargs["packed_seq_params"] = self.prefix.params(ids, packed, samples, whole)
        return self.model(*args, **kwargs)


class NotedBatches:
    """The forward step's micro-batch iterator: each `ProcessedMicrobatch` it hands out noted on the
    planned model (its packed `input_ids`, whole beside the context-parallel share the model is called
    with), for that forward step's one model call."""

    def __init__(self, iterator: Any, model: PlannedModel) -> None:
        self.iterator, self.model = iterator, model

    def __iter__(self) -> NotedBatches:
        return self

    def __next__(self) -> Any:
        batch = next(self.iterator)
        self.model.whole = getattr(batch, "input_ids", None)
        return batch

    def __getattr__(self, name: str) -> Any:
        if name in ("iterator", "model"):
            raise AttributeError(name)
        return getattr(self.iterator, name)


def whole_row_reason(ids: Any, packed: Any) -> str | None:
    """Why a micro-batch is not one a plan takes, from NeMo-RL's model call (the same on every rank
    of a micro-batch: its data)."""
    if packed is None or getattr(packed, "qkv_format", None) != "thd":
        return "no thd packed_seq_params"
    if ids is None or ids.dim() != 2 or ids.shape[0] != 1:
        return f"input_ids of shape {None if ids is None else tuple(ids.shape)}"
    return None


def forward_step_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for NeMo-RL's `forward_with_post_processing_fn(data_iterator, model, ...)`: the
    model planned when the iterator carries its pass's `PrefixPass`."""
    bound = bind(wrapped, args, kwargs)
    prefix = None if bound is None else carried_pass(bound.arguments.get("data_iterator"))
    if bound is None or prefix is None:
        return wrapped(*args, **kwargs)
    planned = PlannedModel(bound.arguments["model"], prefix)
    bound.arguments["model"] = planned
    bound.arguments["data_iterator"] = NotedBatches(bound.arguments["data_iterator"], planned)
    return wrapped(*bound.args, **bound.kwargs)
