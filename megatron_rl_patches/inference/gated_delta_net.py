"""A gated-delta-net linear-attention layer (Qwen3.5's and Qwen3-Next's `linear_attn`) as a
megatron-core self-attention module that runs on CPU: megatron-core's own GatedDeltaNet needs
flash-linear-attention, whose kernels are GPU only, and refuses packed sequences on its torch path.
Its parameters carry megatron-core's names and layout (in_proj = [q, k, v, z, b, a] per
tensor-parallel rank, conv1d over [q, k, v], A_log, dt_bias, out_norm, out_proj), so one loader
serves both. The recurrence runs on flash-linear-attention's kernel when that is installed and the
tensors are on a GPU, in torch otherwise (gated_delta_rule.py); packed sequences (cu_seqlens) run
the convolution and the recurrence one sequence at a time.

Sequence parallelism: the input and output linears gather and scatter the sequence over the
tensor-parallel ranks, as megatron-core's linears do; the recurrence sees whole sequences.
Context parallelism: a rank holds only some rows of each sequence (megatron-core's zigzag layout,
or slime's contiguous `--allgather-cp` slices), and the recurrence needs every earlier row. The
ranks of the context-parallel group exchange the projected rows once, all-to-all, so that each
holds every row of 1/cp of the heads (where cp divides this rank's key heads), run the recurrence
on whole sequences for those heads, and exchange back: every rank ends with its own rows of every
head, and each does 1/cp of the recurrence's work. Where cp does not divide the key heads, each
rank gathers every row of every head and keeps its own rows of the result (the same values, cp
times the work). The exchange carries no gradient: the layer serves inference-only models.

A shared-prefix plan (`packed_seq_params` holding one, shared_prefix/): each segment of the plan's
stream continues its parent's recurrent state and convolution window (shared_prefix/gated_delta_net.py,
the continuation megatron-core's GatedDeltaNet runs too), at one context-parallel rank."""
from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl_patches.inference.gated_delta_rule import (
    causal_depthwise_conv,
    chunk_gated_delta_rule,
    gated_delta_rule,
    l2_normalized,
)
from megatron_rl_patches.ops.context_rows import check_layout, local_rows
from megatron_rl_patches.shared_prefix.gated_delta_net import (
    Segment,
    checked_segments,
    plan_segments,
    segment_convolution,
    segment_recurrence,
)
from megatron_rl_patches.shared_prefix.kinds.gated_delta_nets import PACKAGE_GATED_DELTA_NET
from megatron_rl_patches.shared_prefix.kinds.kind import known_as
from megatron_rl_patches.shared_prefix.plan import shared_prefix_plan_of


class GatedRMSNorm(torch.nn.Module):
    """RMSNorm over a value head, scaled by w (not zero-centred), times silu(gate); in float32."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(width, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def _fla_rule() -> Any:
    """flash-linear-attention's chunked gated delta rule, or None where it is not installed."""
    if importlib.util.find_spec("fla") is None:
        return None
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # lazy: optional dependency fla (GPU only)

    return chunk_gated_delta_rule


@known_as(PACKAGE_GATED_DELTA_NET)  # a shared-prefix plan runs it: it reads the plan itself
class GatedDeltaNetLayer(torch.nn.Module):
    """[s, b, hidden] -> ([s, b, hidden], None), as megatron-core's attention modules return. Heads
    are split over the tensor-parallel ranks as megatron-core splits them (key heads and value
    heads each in contiguous blocks): those of `pg_collection`'s tensor-parallel group (the model's
    groups, which megatron-core's TransformerLayer hands its self-attention: a teacher at its own
    layout), else of parallel_state; the context-parallel group likewise. `cp_layout`: which rows a
    context-parallel rank holds ("zigzag", megatron-core's; "contiguous", slime's --allgather-cp)."""

    def __init__(self, config: Any, layer_number: int | None = None, *, key_heads: int, value_heads: int,
                 key_head_dim: int, value_head_dim: int, conv_kernel: int, pg_collection: Any = None,
                 cp_layout: str = "zigzag", **unused: Any) -> None:
        super().__init__()
        # lazy: optional dependency megatron-core
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        tp, group = tensor_parallel_of(pg_collection)
        self.cp_group, self.cp_size = context_parallel_of(pg_collection)
        self.cp_layout = check_layout(cp_layout)
        if key_heads % tp or value_heads % tp or value_heads % key_heads:
            raise ValueError(f"linear attention with {key_heads} key heads and {value_heads} value heads cannot be "
                             f"split over {tp} tensor-parallel ranks (both must be multiples of it, and the value "
                             "heads a multiple of the key heads)")
        self.config, self.layer_number = config, layer_number
        self.key_heads, self.value_heads = key_heads // tp, value_heads // tp  # this rank's
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        qk, v = self.key_heads * key_head_dim, self.value_heads * value_head_dim
        self.widths = [qk, qk, v, v, self.value_heads, self.value_heads]  # this rank's q, k, v, z, b, a
        dtype = config.params_dtype
        self.in_proj = ColumnParallelLinear(config.hidden_size, sum(self.widths) * tp, config=config,
                                            init_method=config.init_method, gather_output=False, bias=False,
                                            skip_bias_add=False, **group)
        channels = 2 * qk + v
        self.conv1d = torch.nn.Conv1d(channels, channels, conv_kernel, groups=channels, bias=False, dtype=dtype)
        self.A_log = torch.nn.Parameter(torch.zeros(self.value_heads, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.zeros(self.value_heads, dtype=dtype))
        self.out_norm = GatedRMSNorm(value_head_dim, config.layernorm_epsilon, dtype)
        self.out_proj = RowParallelLinear(v * tp, config.hidden_size, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=True, **group)
        for param in (self.conv1d.weight, self.A_log, self.dt_bias):  # split over the ranks, as megatron marks it
            for name, value in (("tensor_model_parallel", True), ("partition_dim", 0), ("partition_stride", 1)):
                setattr(param, name, value)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, packed_seq_params: Any = None,
                **unused: Any) -> tuple[torch.Tensor, Any]:
        projected, _ = self.in_proj(hidden_states)  # sequence parallel: the whole sequence from here
        mixed = projected.transpose(0, 1)  # [b, s, width]
        plan = shared_prefix_plan_of(packed_seq_params)
        if plan is not None:
            if self.cp_size > 1:
                raise ValueError(f"shared prefix: the package's gated delta net runs a plan at one context-parallel "
                                 f"rank, got {self.cp_size}; run this model without a sharing plan")
            if mixed.shape[0] != 1:
                raise ValueError(f"shared prefix: a plan's stream is one batch row, the gated delta net got "
                                 f"{mixed.shape[0]}")
            out = self._mix(mixed, segments=checked_segments(plan_segments(plan), mixed.shape[1]))
        elif self.cp_size == 1:
            out = self._mix_sequences(mixed, packed_seq_params, 0, 1)
        else:
            out = self._mix_context_parallel(mixed, packed_seq_params)
        output, bias = self.out_proj(out.transpose(0, 1).contiguous())
        return output, bias

    def _mix_sequences(self, mixed: torch.Tensor, packed_seq_params: Any, part: int, parts: int) -> torch.Tensor:
        """[b, s, width of heads part/parts] -> [b, s, their values]: the batch's rows as sequences,
        or (packed) each sequence of cu_seqlens on its own."""
        if packed_seq_params is None:
            return self._mix(mixed, part, parts)
        bounds = _sequence_bounds(packed_seq_params, mixed.shape[0] * mixed.shape[1])
        flat = mixed.reshape(1, -1, mixed.shape[-1])
        return torch.cat([self._mix(flat[:, start:end], part, parts) for start, end in bounds], dim=1).view(
            *mixed.shape[:2], -1)

    def _mix_context_parallel(self, mixed: torch.Tensor, packed_seq_params: Any) -> torch.Tensor:
        """This rank's rows [b, s_local, width] -> their values [b, s_local, v], the recurrence run
        over whole sequences (every context-parallel rank's rows, put back in sequence order)."""
        cp, rank, group = self.cp_size, dist.get_rank(self.cp_group), self.cp_group
        b, local, _ = mixed.shape
        if packed_seq_params is None:
            where: dict[str, Any] = {"length": local * cp}
        else:
            if b != 1:
                raise ValueError(f"packed (thd) input has one batch row, got {b}")
            where = {"cu_seqlens": _cu_seqlens(packed_seq_params)}
        rows = [local_rows(self.cp_layout, r, cp, **where).to(mixed.device) for r in range(cp)]
        if self.key_heads % cp:  # every rank every head: gather all rows, keep its own of the result
            parts = [torch.empty_like(mixed) for _ in range(cp)]
            dist.all_gather(parts, mixed.contiguous(), group=group)
            whole = _in_sequence_order(parts, rows)
            return self._mix_sequences(whole, packed_seq_params, 0, 1).index_select(1, rows[rank])
        send = torch.stack([self._head_columns(mixed, c, cp) for c in range(cp)])
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)  # [r]: rank r's rows of this rank's heads
        out = self._mix_sequences(_in_sequence_order(list(received), rows), packed_seq_params, rank, cp)
        back = torch.stack([out.index_select(1, rows[c]) for c in range(cp)])
        returned = torch.empty_like(back)
        dist.all_to_all_single(returned, back, group=group)  # [r]: this rank's rows of rank r's heads
        return torch.cat(list(returned), dim=-1)

    def _head_columns(self, mixed: torch.Tensor, part: int, parts: int) -> torch.Tensor:
        """The columns of heads part/parts (1/parts of the key heads, their value heads) of each of
        q, k, v, z, b, a: the layout `_mix(..., part, parts)` reads."""
        return torch.cat([piece.chunk(parts, dim=-1)[part] for piece in torch.split(mixed, self.widths, dim=-1)],
                         dim=-1)

    def _mix(self, mixed: torch.Tensor, part: int = 0, parts: int = 1,
             segments: tuple[Segment, ...] | None = None) -> torch.Tensor:
        """One sequence (or a batch of unpacked ones) [b, s, width] of heads part/parts -> the gated,
        normed values [b, s, v] of those heads; `segments`: a plan's stream [1, s, width] of every
        head, each segment continuing its parent."""
        b, s, _ = mixed.shape
        key_heads, value_heads = self.key_heads // parts, self.value_heads // parts
        widths = [w // parts for w in self.widths]
        q, k, v, z, write, a = torch.split(mixed, widths, dim=-1)
        qkv = torch.cat([q, k, v], dim=-1).transpose(1, 2)
        weight = self.conv1d.weight
        if parts > 1:  # the depthwise channels of these heads' q, k and v
            weight = torch.cat([w.chunk(parts)[part] for w in torch.split(weight, self.widths[:3])])
        if segments is None:
            qkv = F.silu(causal_depthwise_conv(qkv.to(weight.dtype), weight)).transpose(1, 2)
        else:
            qkv = F.silu(segment_convolution(self.conv1d, qkv[0].t().to(weight.dtype), segments))[None]
        q, k, v = torch.split(qkv.to(mixed.dtype), widths[:3], dim=-1)
        q, k = (x.reshape(b, s, key_heads, self.key_head_dim) for x in (q, k))
        v = v.reshape(b, s, value_heads, self.value_head_dim)
        heads = slice(part * value_heads, (part + 1) * value_heads)
        g = -self.A_log[heads].float().exp() * F.softplus(a.float() + self.dt_bias[heads])
        beta = write.sigmoid()
        repeat = value_heads // key_heads
        fla = _fla_rule() if v.is_cuda else None
        if fla is not None:
            q, k = (x.repeat_interleave(repeat, dim=2) for x in (q, k))
            if segments is None:
                core, _ = fla(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
            else:
                core = segment_recurrence(fla, q, k, v, g, beta, segments, use_qk_l2norm_in_kernel=True)
        else:
            q, k = (l2_normalized(x.float()).repeat_interleave(repeat, dim=2) for x in (q, k))
            if segments is None:
                core = gated_delta_rule(q, k, v, g, beta).to(v.dtype)
            else:
                core = segment_recurrence(chunk_gated_delta_rule, q, k, v, g, beta, segments).to(v.dtype)
        gated = self.out_norm(core, z.reshape(b, s, value_heads, self.value_head_dim))
        return gated.reshape(b, s, -1)


def use_context_parallel_rows(chunks: Any, layout: str) -> int:
    """Set which rows a context-parallel rank holds ("zigzag" or "contiguous") on every gated-delta-net
    layer of `chunks` (a model, or a list of its chunks), as the framework cuts its batches (slime's
    `--allgather-cp`: contiguous slices); returns how many layers it set."""
    layout = check_layout(layout)
    layers = [module for chunk in (chunks if isinstance(chunks, (list, tuple)) else [chunks])
              for module in chunk.modules() if isinstance(module, GatedDeltaNetLayer)]
    for layer in layers:
        layer.cp_layout = layout
    return len(layers)


def tensor_parallel_of(pg_collection: Any) -> tuple[int, dict[str, Any]]:
    """(tensor-parallel size, the linears' `tp_group=` keyword) of the model's process groups: the
    tensor-parallel group of `pg_collection` (megatron-core's ProcessGroupCollection, which its
    TransformerLayer hands every self-attention module: a teacher's own layout's groups) where it
    has one, else parallel_state's (no keyword: the linears read the same group there)."""
    group = getattr(pg_collection, "tp", None)
    if group is None:
        from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

        return ps.get_tensor_model_parallel_world_size(), {}
    return dist.get_world_size(group), {"tp_group": group}


def context_parallel_of(pg_collection: Any) -> tuple[Any, int]:
    """(context-parallel group, its size) of the model's process groups: `pg_collection`'s where it
    has one, else parallel_state's (None and 1 where parallel_state has none)."""
    group = getattr(pg_collection, "cp", None)
    if group is not None:
        return group, dist.get_world_size(group)
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    size = ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    return (ps.get_context_parallel_group() if size > 1 else None), size


def _in_sequence_order(parts: list[torch.Tensor], rows: list[torch.Tensor]) -> torch.Tensor:
    """Each context-parallel rank's rows [b, s_local, w] (rank order) placed at their positions
    `rows[r]` of the whole [b, s_local * cp, w]."""
    whole = parts[0].new_empty(parts[0].shape[0], parts[0].shape[1] * len(parts), parts[0].shape[2])
    for part, where in zip(parts, rows):
        whole.index_copy_(1, where, part)
    return whole


def _cu_seqlens(packed_seq_params: Any) -> torch.Tensor:
    """The global boundaries of the packed sequences (padded where the framework pads)."""
    cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    return packed_seq_params.cu_seqlens_q if cu is None else cu


def _sequence_bounds(packed_seq_params: Any, rows: int) -> list[tuple[int, int]]:
    """(start, end) of each packed sequence (cu_seqlens, padded where the framework pads)."""
    edges = [int(x) for x in _cu_seqlens(packed_seq_params).tolist()]
    if edges[0] != 0 or edges[-1] != rows or any(b < a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"cu_seqlens {edges} do not cover the {rows} packed rows from 0")
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
