"""megatron-core's `GatedDeltaNet` (Qwen3.5's and Qwen3-Next's linear attention) over a shared-prefix
plan, in training: the module's class becomes a subclass whose forward takes a plan's route and
calls its own class otherwise (as a plain core attention's does, kinds.plain_cores.shared_prefix_core_class).

A gated delta net carries what a sequence has seen in two places: the recurrent state [heads, dk,
dv] and the short convolution's window (the last kernel - 1 rows of q, k, v before it). The plan's
physical stream is a list of segments, each either on its own (a sample alone, padding) or
continuing its parent (a remainder continues its group's prefix): a segment starts from its
parent's final state and its parent's window, computed once; the gradient of every child reaches
the parent through them (autograd sums it, as over rows the samples share). Everything per token
(in_proj, gate, beta, alpha, the norms, out_proj) runs over the whole stream at once, as megatron-
core runs it; the convolution and the recurrence run segment by segment, parents first.

The recurrence is megatron-core's own: `torch_chunk_gated_delta_rule` in deterministic mode,
flash-linear-attention's `chunk_gated_delta_rule` otherwise, both with `initial_state` and
`output_final_state` (each differentiable in the state). The convolution is the module's `conv1d`
(the same weights causal_conv1d takes). Sequence parallelism: in_proj gathers the whole stream
and out_proj scatters it back, as in megatron-core's own forward."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan, shared_prefix_plan_of
from megatron_rl_patches.shared_prefix.prepared import Prepared


@dataclass(frozen=True)
class Segment:
    """Physical rows [start, end) that continue `parent` (an earlier segment's index), or start
    afresh (None)."""

    start: int
    end: int
    parent: int | None = None


def plan_segments(plan: SharedPrefixPlan) -> tuple[Segment, ...]:
    """The plan's segments in its preorder (every parent before its children), each with its parent
    segment (None under the root: a shared prefix's first segment, a sample alone, the padding)."""
    starts, ends, parents = plan.segment_starts.tolist(), plan.segment_ends.tolist(), plan.segment_parents.tolist()
    return tuple(Segment(start, end, parent if parent >= 0 else None)
                 for start, end, parent in zip(starts, ends, parents))


def checked_segments(segments: tuple[Segment, ...], rows: int) -> tuple[Segment, ...]:
    """`segments` if they tile rows [0, rows) and each parent comes before its child; ValueError otherwise."""
    covered = 0
    for segment in sorted(segments, key=lambda s: s.start):
        if segment.start != covered or segment.end < segment.start:
            raise ValueError(f"shared prefix: the plan's segments do not tile the {rows} physical rows "
                             f"(a segment [{segment.start}, {segment.end}) after row {covered})")
        covered = segment.end
    if covered != rows:
        raise ValueError(f"shared prefix: the plan's segments cover {covered} rows, the gated delta net got {rows}")
    for index, segment in enumerate(segments):
        if segment.parent is not None and not 0 <= segment.parent < index:
            raise ValueError(f"shared prefix: segment {index} continues segment {segment.parent}, which does not come "
                             "before it")
    return segments


class PlannedGatedDeltaNet(Prepared):
    """The mark of a GatedDeltaNet whose class `planned_gated_delta_net_class` made."""


def prepare_gated_delta_net(module: Any) -> None:
    """Give `module` (a GatedDeltaNet) the plan's route, once."""
    if not isinstance(module, PlannedGatedDeltaNet):
        module.__class__ = planned_gated_delta_net_class(module.__class__)


@functools.cache
def planned_gated_delta_net_class(cls: Any) -> type:
    """`cls` (a GatedDeltaNet class) whose forward runs a plan's segments; any other call:
    `cls.forward` as it is."""

    def forward(self: Any, hidden_states: Any, attention_mask: Any, key_value_states: Any = None,
                inference_context: Any = None, attention_bias: Any = None, packed_seq_params: Any = None,
                sequence_len_offset: Any = None, *, inference_params: Any = None, **kwargs: Any) -> Any:
        plan = shared_prefix_plan_of(packed_seq_params)
        if plan is None:
            return cls.forward(self, hidden_states, attention_mask, key_value_states, inference_context,
                               attention_bias, packed_seq_params, sequence_len_offset,
                               inference_params=inference_params, **kwargs)
        if inference_context is not None or inference_params is not None:
            raise ValueError("shared prefix: a gated delta net runs a plan in training and scoring, not with an "
                             "inference context")
        return planned_forward(self, hidden_states, plan_segments(plan))

    return type(f"SharedPrefix{cls.__name__}", (cls, PlannedGatedDeltaNet),
                {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__})


def planned_forward(layer: Any, hidden_states: torch.Tensor, segments: tuple[Segment, ...]) -> tuple[Any, Any]:
    """GatedDeltaNet's forward ([s, 1, hidden] -> (out, bias)) over a physical stream of segments."""
    from megatron.core.ssm import gated_delta_net as upstream

    local, batch, _ = hidden_states.shape
    rows = local * layer.sp_size
    if batch != 1:
        raise ValueError(f"shared prefix: a plan's stream is one batch row, the gated delta net got {batch}")
    checked_segments(segments, rows)
    projected, _ = layer.in_proj(hidden_states)  # [rows, 1, width]: the whole stream under SP
    tp = layer.tp_size
    qkv, gate, beta, alpha = torch.split(
        projected[:, 0], [(2 * layer.qk_dim + layer.v_dim) // tp, layer.v_dim // tp, layer.num_value_heads // tp,
                          layer.num_value_heads // tp], dim=-1)
    mixed = layer.act_fn(segment_convolution(layer.conv1d, qkv, segments))  # [rows, channels]
    query, key, value = torch.split(mixed, [layer.qk_dim // tp, layer.qk_dim // tp, layer.v_dim // tp], dim=-1)
    query = query.reshape(1, rows, -1, layer.key_head_dim)
    key = key.reshape(1, rows, -1, layer.key_head_dim)
    value = value.reshape(1, rows, -1, layer.value_head_dim).contiguous()
    if layer.use_qk_l2norm:
        query, key = upstream.l2norm(query.contiguous()), upstream.l2norm(key.contiguous())
    repeat = layer.num_value_heads // layer.num_key_heads
    if repeat > 1:
        query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
    g = -layer.A_log.exp() * F.softplus(alpha[None].float() + layer.dt_bias)  # in float32, as upstream
    rule = upstream.torch_chunk_gated_delta_rule if layer.config.deterministic_mode else upstream.chunk_gated_delta_rule
    core = segment_recurrence(rule, query.contiguous(), key.contiguous(), value, g, beta[None].sigmoid(), segments)
    gate = gate.reshape(1, rows, -1, layer.value_head_dim)
    normed = layer._apply_gated_norm(core, gate.contiguous())
    out, out_bias = layer.out_proj(normed.reshape(rows, 1, -1))
    return out, out_bias


def segment_convolution(conv: torch.nn.Conv1d, qkv: torch.Tensor, segments: tuple[Segment, ...]) -> torch.Tensor:
    """The causal depthwise convolution of each segment [rows, channels] (before the activation),
    each seeing the kernel - 1 rows before it in its own line: its parent's window (and its
    parent's, for a parent shorter than the window), zeros where the line begins. `conv`: any
    depthwise Conv1d (its weight [channels, 1, kernel] and bias; megatron-core's, the package's,
    flash-linear-attention's ShortConvolution), whatever its own padding and forward."""
    keep = conv.kernel_size[0] - 1
    lines = qkv.t()  # [channels, rows]
    windows: list[torch.Tensor] = []
    pieces: dict[int, torch.Tensor] = {}
    for segment in segments:
        before = lines.new_zeros(lines.shape[0], keep) if segment.parent is None else windows[segment.parent]
        context = torch.cat([before, lines[:, segment.start:segment.end]], dim=1)
        windows.append(context[:, context.shape[1] - keep:])
        if segment.end > segment.start:  # output j sees context[j : j + kernel]
            pieces[segment.start] = F.conv1d(context[None], conv.weight, conv.bias, groups=lines.shape[0])[0]
    return torch.cat([pieces[start] for start in sorted(pieces)], dim=1).t()


def segment_recurrence(rule: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, segments: tuple[Segment, ...],
                       use_qk_l2norm_in_kernel: bool = False) -> torch.Tensor:
    """The gated delta rule over each segment ([1, rows, heads, d] in, [1, rows, heads, dv] out),
    each from its parent's final state (zeros without a parent). `rule`: flash-linear-attention's
    `chunk_gated_delta_rule` calling convention (initial_state, output_final_state; returns the
    output and the final state), which megatron-core's, transformers' and the package's torch
    rules share."""
    if rule is None:
        raise ValueError("shared prefix: a gated delta net outside deterministic mode needs flash-linear-attention's "
                         "chunk_gated_delta_rule (not installed); set config.deterministic_mode=True for "
                         "megatron-core's torch path")
    parents = {segment.parent for segment in segments}
    states: list[Any] = []
    pieces: dict[int, torch.Tensor] = {}
    for index, segment in enumerate(segments):
        initial = None if segment.parent is None else states[segment.parent]
        rows = slice(segment.start, segment.end)
        if segment.end == segment.start:
            states.append(initial)
            continue
        out, final = rule(query[:, rows], key[:, rows], value[:, rows], g=g[:, rows], beta=beta[:, rows],
                          initial_state=initial, output_final_state=index in parents,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        states.append(final)
        pieces[segment.start] = out
    return torch.cat([pieces[start] for start in sorted(pieces)], dim=1)
