"""slime's own gated-delta-net layers (Qwen3.5's and Qwen3-Next's `Attention(HuggingfaceAttention)`
in slime_plugins/models/qwen3_5.py and qwen3_next.py) over a shared-prefix plan: a model kind of
slime's (`SlimeGatedDeltaNet`, its object registered by `model_kinds.register_model_kinds` at slime's
shared-prefix door), recognized by its code (the layer's `hf_forward` slime's, its forward slime's
`HuggingfaceAttention`'s; its linear attention and that one's short convolution by their forward).

slime's layer hands `packed_seq_params.cu_seqlens_q` to its `linear_attn`, which passes it, as it
is, to exactly two calls: the short convolution (`self.conv1d(x=..., cu_seqlens=...)`, flash-linear-
attention's ShortConvolution) and the recurrence (`self.chunk_gated_delta_rule(..., cu_seqlens=...)`,
flash-linear-attention's or FlashQLA's kernel). Under a plan the layer's `hf_forward` hands on the
plan's segments (`PlannedStream`) in place of cu_seqlens, and those two calls, prepared once, run
them as megatron-core's GatedDeltaNet does (`gated_delta_net.segment_convolution` /
`segment_recurrence`: each remainder from its prefix's convolution window and final recurrent
state, computed once; the gradients reach the prefix through them). Everything per token (the
input norm, the projections, the gate, the output norm and projection) runs over the whole stream
as slime wrote it; sequence parallelism gathers and scatters in slime's own forward around it.

The recurrence is the layer's own kernel, called per segment with `initial_state` and
`output_final_state` (flash-linear-attention's chunked kernel on CUDA; on CPU a torch stand-in
with the same calling convention, the lane's). FlashQLA's kernel (its initial-state gradient
unchecked) is refused by name (the kind's `reason`).

Under context parallelism slime's own forward gathers each sequence's zigzag rows of cu_seqlens,
which a plan's stream does not have; the planned layer's forward instead gathers every rank's share
of the physical stream (`context_parallel.gathered_stream`: the backward sums the gradient over the
ranks and keeps each rank's own rows, since a rank's rows reach every later row of the recurrence),
runs the layer over the whole stream on every rank, and keeps this rank's rows of its output."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl_patches.model.kinds import qualified_name
from megatron_rl_patches.shared_prefix.context_parallel import Share, gathered_stream, module_share
from megatron_rl_patches.shared_prefix.gated_delta_net import (
    PlannedGatedDeltaNet,
    Segment,
    checked_segments,
    plan_segments,
    segment_convolution,
    segment_recurrence,
)
from megatron_rl_patches.shared_prefix.kinds.kind import ByCode, loaded_class, owner
from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan, shared_prefix_plan_of
from megatron_rl_patches.shared_prefix.prepared import Prepared, own_class

LAYERS = ("slime_plugins.models.qwen3_5:Attention", "slime_plugins.models.qwen3_next:Attention")  # own hf_forward
HF_ATTENTION = "slime_plugins.models.hf_attention:HuggingfaceAttention"  # the layers' forward
BACKENDS = ("fla",)  # the layer's `gdn_backend`s whose kernel takes a differentiable initial state


def is_slime_gated_delta_net(module: Any) -> bool:
    """slime's Qwen3.5 / Qwen3-Next gated-delta-net layer, by its code: slime's `hf_forward` under slime's
    `HuggingfaceAttention.forward` (found among the loaded modules: nothing of slime is imported)."""
    own = own_class(type(module))
    layers = [loaded_class(path) for path in LAYERS]
    return owner(own, "hf_forward") in [c for c in layers if c is not None] and \
        owner(own, "forward") is loaded_class(HF_ATTENTION) is not None


def slime_gated_delta_net_reason(module: Any, path: str) -> str | None:
    """Why a plan cannot run slime's gated-delta-net layer `module` (at `path`), or None."""
    backend = getattr(getattr(module, "linear_attn", None), "gdn_backend", "fla")
    if backend not in BACKENDS:
        return (f"slime's gated delta net layer ({qualified_name(type(module))} at {path}) on --qwen-gdn-backend "
                f"{backend}: a plan continues each remainder from its prefix's state through the kernel's "
                f"initial_state, checked for {', '.join(BACKENDS)} only; run it with --qwen-gdn-backend fla")
    return None


@dataclass(frozen=True)
class PlannedStream:
    """What slime's layer hands its convolution and recurrence in place of cu_seqlens under a plan."""

    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class StreamParams:
    """The packed_seq_params slime's `hf_forward` reads under a plan (cu_seqlens_q only)."""

    cu_seqlens_q: PlannedStream


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
            raise ValueError("shared prefix: slime's gated delta net runs a plan from zero states, by keyword")
        l2 = bool(kwargs.pop("use_qk_l2norm_in_kernel", False))
        if kwargs:
            raise ValueError(f"shared prefix: slime's gated delta net called its kernel with {sorted(kwargs)}, which a "
                             "plan does not run")
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
            raise ValueError("shared prefix: slime's gated delta net runs its convolution over a plan without "
                             "residual, mask or cache")
        activation = getattr(self, "activation", None)
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"shared prefix: a short convolution with activation {activation!r} (a plan runs silu "
                             "or none)")
        mixed = segment_convolution(self, x[0], stream.segments)
        return (mixed if activation is None else F.silu(mixed))[None].to(x.dtype), None

    return type(f"SharedPrefix{cls.__name__}", (cls, PlannedShortConvolution),
                {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__})


@functools.cache
def planned_layer_class(cls: Any) -> type:
    """`cls` (slime's layer) whose `hf_forward` hands its linear attention the plan's segments."""

    def hf_forward(self: Any, hidden_states: torch.Tensor, packed_seq_params: Any) -> Any:
        plan = shared_prefix_plan_of(packed_seq_params)
        if plan is None:
            return cls.hf_forward(self, hidden_states, packed_seq_params)
        reason = slime_gated_delta_net_reason(self, f"layer {getattr(self, 'layer_number', '?')}")
        if reason is not None:
            raise ValueError(f"shared prefix: {reason}")
        batch, rows = hidden_states.shape[:2]
        if batch != 1:
            raise ValueError(f"shared prefix: a plan's stream is one batch row, slime's gated delta net got {batch}")
        segments = checked_segments(plan_segments(plan), rows)
        return cls.hf_forward(self, hidden_states, StreamParams(PlannedStream(segments)))

    signature = inspect.signature(cls.forward)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs).arguments
        params = bound.get("packed_seq_params")
        plan = shared_prefix_plan_of(params)
        held = None if plan is None else module_share(self, plan, params)
        if plan is None or held is None:  # no plan, or one context-parallel rank: slime's forward as it is
            return cls.forward(self, *args, **kwargs)
        return context_parallel_forward(self, bound["hidden_states"], params, plan, *held)

    return type(f"SharedPrefix{cls.__name__}", (cls, PlannedGatedDeltaNet),
                {"forward": forward, "hf_forward": hf_forward, "__module__": cls.__module__, "__doc__": cls.__doc__})


def context_parallel_forward(layer: Any, hidden_states: torch.Tensor, params: Any, plan: SharedPrefixPlan,
                             share: Share, group: Any) -> tuple[torch.Tensor, None]:
    """slime's layer forward ([rows, 1, hidden] of this rank's share -> (out, None)) at context
    parallelism: the whole physical stream gathered, the layer run over it, this rank's rows kept;
    under sequence parallelism the tensor-parallel rows gathered and scattered around it as slime does
    (the layer is duplicated over the tensor-parallel ranks)."""
    from megatron.core import parallel_state, tensor_parallel  # lazy: optional dependency megatron-core

    sequence_parallel = bool(getattr(layer.args, "sequence_parallel", False))
    tp = parallel_state.get_tensor_model_parallel_group() if sequence_parallel else None
    if sequence_parallel:
        hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=False, group=tp)
    whole = gathered_stream(hidden_states, plan, share, group)
    output = layer.hf_forward(whole.permute(1, 0, 2), params).permute(1, 0, 2)
    device = output.device
    mine = plan.cached(("cp-physical-on", share.size, share.rank, str(device)), lambda: share.physical.to(device))
    output = output.index_select(0, mine)
    if sequence_parallel:
        output = tensor_parallel.scatter_to_sequence_parallel_region(output, group=tp)
    return output, None


def prepare_slime_gated_delta_net(module: Any) -> None:
    """Give slime's layer `module` the plan's route, once: its `hf_forward`, its linear attention's
    short convolution and recurrence kernel."""
    if isinstance(module, PlannedGatedDeltaNet):
        return
    linear = module.linear_attn
    module.__class__ = planned_layer_class(module.__class__)
    if not isinstance(linear.conv1d, PlannedShortConvolution):
        linear.conv1d.__class__ = planned_convolution_class(linear.conv1d.__class__)
    if not isinstance(linear.chunk_gated_delta_rule, PlannedRule):
        linear.chunk_gated_delta_rule = PlannedRule(linear.chunk_gated_delta_rule)


class SlimeGatedDeltaNet(ByCode):
    """slime's layer (prepared: `prepare_slime_gated_delta_net`; refused on a kernel whose initial state
    has no checked gradient) and, by their forward, its linear attention and short convolution, which
    run under the prepared layer."""

    def recognizes(self, module: Any) -> bool:
        return is_slime_gated_delta_net(module) or super().recognizes(module)

    def reason(self, module: Any, path: str) -> str | None:
        return slime_gated_delta_net_reason(module, path) if is_slime_gated_delta_net(module) else None

    def prepare(self, module: Any) -> bool:
        if not is_slime_gated_delta_net(module):
            return False
        prepare_slime_gated_delta_net(module)
        return True

