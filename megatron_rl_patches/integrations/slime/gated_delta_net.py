"""slime's own gated-delta-net layers (Qwen3.5's and Qwen3-Next's `Attention(HuggingfaceAttention)`,
slime_plugins/models/qwen3_5.py and qwen3_next.py) over a shared-prefix plan: a model kind of slime's
(`SlimeGatedDeltaNet`, registered by `model_kinds.register_model_kinds` at slime's door), recognized
by its code (its `hf_forward` and forward slime's; its linear attention and short convolution by theirs).

Under a plan the layer's `hf_forward` hands its `linear_attn` the plan's segments (and a step's held
states) in place of `cu_seqlens_q`, and the convolution and recurrence run them
(`shared_prefix.linear_attention`); everything per token runs over the whole stream as slime wrote it,
sequence parallelism gathering and scattering in slime's forward. The recurrence is the layer's own
kernel (flash-linear-attention's on CUDA; the lane's torch stand-in on CPU); FlashQLA's (its
initial-state gradient unchecked) is refused by name. Under context parallelism the planned forward
runs the layer over the whole physical stream on every rank (`linear_attention.whole_stream_forward`),
where slime's own would gather zigzag rows a plan's stream does not have."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.model.kinds import qualified_name
from megatron_rl_patches.shared_prefix.context_parallel import module_share
from megatron_rl_patches.shared_prefix.gated_delta_net import (
    HeldStates,
    PlannedGatedDeltaNet,
    checked_segments,
    plan_segments,
)
from megatron_rl_patches.shared_prefix.kinds.kind import ByCode, loaded_class, owner
from megatron_rl_patches.shared_prefix.linear_attention import (
    PlannedStream,
    prepare_linear_attention,
    whole_stream_forward,
)
from megatron_rl_patches.shared_prefix.plan import shared_prefix_plan_of
from megatron_rl_patches.shared_prefix.prepared import own_class

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
class StreamParams:
    """The packed_seq_params slime's `hf_forward` reads under a plan (cu_seqlens_q only)."""

    cu_seqlens_q: PlannedStream


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
        return cls.hf_forward(self, hidden_states, StreamParams(PlannedStream(segments, HeldStates(plan, self))))

    signature = inspect.signature(cls.forward)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs).arguments
        params = bound.get("packed_seq_params")
        plan = shared_prefix_plan_of(params)
        held = None if plan is None else module_share(self, plan, params)
        if plan is None or held is None:  # no plan, or one context-parallel rank: slime's forward as it is
            return cls.forward(self, *args, **kwargs)
        return whole_stream_forward(lambda whole: self.hf_forward(whole.permute(1, 0, 2), params).permute(1, 0, 2),
                                    bound["hidden_states"], plan, *held,
                                    bool(getattr(self.args, "sequence_parallel", False)))

    return type(f"SharedPrefix{cls.__name__}", (cls, PlannedGatedDeltaNet),
                {"forward": forward, "hf_forward": hf_forward, "__module__": cls.__module__, "__doc__": cls.__doc__})


def prepare_slime_gated_delta_net(module: Any) -> None:
    """Give slime's layer `module` the plan's route, once: its `hf_forward`, its linear attention's
    short convolution and recurrence kernel."""
    if isinstance(module, PlannedGatedDeltaNet):
        return
    module.__class__ = planned_layer_class(module.__class__)
    prepare_linear_attention(module.linear_attn)


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

