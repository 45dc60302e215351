"""A gated delta net layer built the Hugging Face way (transformers' Qwen3-Next / Qwen3.5 linear
attention, and the frameworks' copies of it: a `linear_attn` whose forward hands `cu_seqlens`, as it
is, to exactly two calls in flash-linear-attention's calling convention: its short convolution
`conv1d(x=..., cu_seqlens=...)` and its recurrence `chunk_gated_delta_rule(..., cu_seqlens=...)`)
over a shared-prefix plan. The layer hands on the plan's segments (`PlannedStream`) in place of
cu_seqlens, and those two calls, prepared once (`prepare_linear_attention`), run them as
megatron-core's GatedDeltaNet does (`gated_delta_net.segment_convolution` / `segment_recurrence`:
each remainder from its prefix's convolution window and final recurrent state, computed once; the
gradients reach the prefix through them); any other call runs as it is. The recurrence is the
layer's own kernel, called per segment with `initial_state` and `output_final_state`.

At context parallelism such a layer runs over the whole physical stream on every rank
(`whole_stream_forward`: every rank's share gathered by `context_parallel.gathered_stream`, whose
backward sums the gradient over the ranks and keeps each rank's own rows, since a rank's rows reach
every later row of the recurrence), and keeps this rank's rows of its output."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl_patches.shared_prefix.context_parallel import Share, gathered_stream
from megatron_rl_patches.shared_prefix.gated_delta_net import Segment, segment_convolution, segment_recurrence
from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan
from megatron_rl_patches.shared_prefix.prepared import Prepared


@dataclass(frozen=True)
class PlannedStream:
    """What the layer hands its convolution and recurrence in place of cu_seqlens under a plan."""

    segments: tuple[Segment, ...]


class PlannedRule:
    """The layer's recurrence kernel, run per segment of a `PlannedStream` (any other call: the
    kernel as it is)."""

    def __init__(self, rule: Any) -> None:
        self.rule = rule

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                 cu_seqlens: Any = None, **kwargs: Any) -> Any:
        if not isinstance(cu_seqlens, PlannedStream):
            return self.rule(query, key, value, *args, cu_seqlens=cu_seqlens, **kwargs)
        g, beta = kwargs.pop("g"), kwargs.pop("beta")
        if args or kwargs.pop("initial_state", None) is not None or kwargs.pop("output_final_state", False):
            raise ValueError("shared prefix: a gated delta net layer runs a plan from zero states, by keyword")
        l2 = bool(kwargs.pop("use_qk_l2norm_in_kernel", False))
        if kwargs:
            raise ValueError(f"shared prefix: a gated delta net layer called its kernel with {sorted(kwargs)}, which "
                             "a plan does not run")
        out = segment_recurrence(self.rule, query, key, value, g, beta, cu_seqlens.segments,
                                 use_qk_l2norm_in_kernel=l2)
        return out, None


class PlannedShortConvolution(Prepared):
    """The mark of a short convolution whose class `planned_convolution_class` made."""


@functools.cache
def planned_convolution_class(cls: Any) -> type:
    """`cls` (flash-linear-attention's ShortConvolution, a depthwise nn.Conv1d taking [b, t, channels])
    whose forward runs a `PlannedStream` per segment, then its activation; any other call as it is."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        stream = kwargs.get("cu_seqlens")
        if not isinstance(stream, PlannedStream):
            return cls.forward(self, *args, **kwargs)
        x = kwargs.pop("x") if "x" in kwargs else args[0]
        if any(kwargs.get(name) is not None for name in ("residual", "mask", "cache")) or len(args) > 1:
            raise ValueError("shared prefix: a gated delta net layer runs its convolution over a plan without "
                             "residual, mask or cache")
        activation = getattr(self, "activation", None)
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"shared prefix: a short convolution with activation {activation!r} (a plan runs silu "
                             "or none)")
        mixed = segment_convolution(self, x[0], stream.segments)
        return (mixed if activation is None else F.silu(mixed))[None].to(x.dtype), None

    return type(f"SharedPrefix{cls.__name__}", (cls, PlannedShortConvolution),
                {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__})


def prepare_linear_attention(linear: Any) -> None:
    """Give `linear` (a layer's `linear_attn`) the plan's route, once: its short convolution and its
    recurrence kernel."""
    if not isinstance(linear.conv1d, PlannedShortConvolution):
        linear.conv1d.__class__ = planned_convolution_class(linear.conv1d.__class__)
    if not isinstance(linear.chunk_gated_delta_rule, PlannedRule):
        linear.chunk_gated_delta_rule = PlannedRule(linear.chunk_gated_delta_rule)


def whole_stream_forward(run: Callable[[torch.Tensor], torch.Tensor], hidden_states: torch.Tensor,
                         plan: SharedPrefixPlan, share: Share, group: Any,
                         sequence_parallel: bool) -> tuple[torch.Tensor, None]:
    """A layer's forward ([rows, 1, hidden] of this rank's context-parallel share -> (out, None)) run
    as `run` ([rows, 1, hidden] of the whole physical stream -> the same rows out) on every rank, this
    rank's rows kept; under sequence parallelism the tensor-parallel rows gathered and scattered
    around it (a layer duplicated over the tensor-parallel ranks)."""
    from megatron.core import parallel_state, tensor_parallel

    tp = parallel_state.get_tensor_model_parallel_group() if sequence_parallel else None
    if sequence_parallel:
        hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=False, group=tp)
    output = run(gathered_stream(hidden_states, plan, share, group))
    device = output.device
    mine = plan.cached(("cp-physical-on", share.size, share.rank, str(device)), lambda: share.physical.to(device))
    output = output.index_select(0, mine)
    if sequence_parallel:
        output = tensor_parallel.scatter_to_sequence_parallel_region(output, group=tp)
    return output, None
