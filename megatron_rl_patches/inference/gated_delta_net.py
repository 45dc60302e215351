"""A gated-delta-net linear-attention layer (Qwen3.5's and Qwen3-Next's `linear_attn`) as a
megatron-core self-attention module that runs on CPU: megatron-core's own GatedDeltaNet needs
flash-linear-attention, whose kernels are GPU only, and refuses packed sequences on its torch path.
Its parameters carry megatron-core's names and layout (in_proj = [q, k, v, z, b, a] per
tensor-parallel rank, conv1d over [q, k, v], A_log, dt_bias, out_norm, out_proj), so one loader
serves both. The recurrence runs on flash-linear-attention's kernel when that is installed and the
tensors are on a GPU, in torch otherwise (gated_delta_rule.py); packed sequences (cu_seqlens) run
the convolution and the recurrence one sequence at a time."""
from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl_patches.inference.gated_delta_rule import causal_depthwise_conv, gated_delta_rule, l2_normalized


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


class GatedDeltaNetLayer(torch.nn.Module):
    """[s, b, hidden] -> ([s, b, hidden], None), as megatron-core's attention modules return. Heads
    are split over the tensor-parallel ranks as megatron-core splits them (key heads and value
    heads each in contiguous blocks): those of `pg_collection`'s tensor-parallel group (the model's
    groups, which megatron-core's TransformerLayer hands its self-attention: a teacher at its own
    layout), else of parallel_state; context parallelism and sequence parallelism are refused."""

    def __init__(self, config: Any, layer_number: int | None = None, *, key_heads: int, value_heads: int,
                 key_head_dim: int, value_head_dim: int, conv_kernel: int, pg_collection: Any = None,
                 **unused: Any) -> None:
        super().__init__()
        # lazy: optional dependency megatron-core
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        if getattr(config, "context_parallel_size", 1) > 1:
            raise ValueError("the gated-delta-net linear-attention layer serves context-parallel size 1 only "
                             f"(got context_parallel_size={config.context_parallel_size}): its recurrence runs over "
                             "each whole sequence")
        if getattr(config, "sequence_parallel", False):
            raise ValueError("the gated-delta-net linear-attention layer does not serve sequence_parallel=True")
        tp, group = tensor_parallel_of(pg_collection)
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
        projected, _ = self.in_proj(hidden_states)
        mixed = projected.transpose(0, 1)  # [b, s, width]
        if packed_seq_params is None:
            out = self._mix(mixed)
        else:
            bounds = _sequence_bounds(packed_seq_params, mixed.shape[0] * mixed.shape[1])
            flat = mixed.reshape(1, -1, mixed.shape[-1])
            out = torch.cat([self._mix(flat[:, start:end]) for start, end in bounds], dim=1).view(
                *mixed.shape[:2], -1)
        output, bias = self.out_proj(out.transpose(0, 1).contiguous())
        return output, bias

    def _mix(self, mixed: torch.Tensor) -> torch.Tensor:
        """One sequence (or a batch of unpacked ones) [b, s, width] -> the gated, normed values [b, s, v]."""
        b, s, _ = mixed.shape
        q, k, v, z, write, a = torch.split(mixed, self.widths, dim=-1)
        qkv = torch.cat([q, k, v], dim=-1).transpose(1, 2)
        qkv = F.silu(causal_depthwise_conv(qkv.to(self.conv1d.weight.dtype), self.conv1d.weight)).transpose(1, 2)
        q, k, v = torch.split(qkv.to(mixed.dtype), self.widths[:3], dim=-1)
        q, k = (x.reshape(b, s, self.key_heads, self.key_head_dim) for x in (q, k))
        v = v.reshape(b, s, self.value_heads, self.value_head_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        beta = write.sigmoid()
        fla = _fla_rule() if v.is_cuda else None
        if fla is not None:
            repeat = self.value_heads // self.key_heads
            q, k = (x.repeat_interleave(repeat, dim=2) for x in (q, k))
            core, _ = fla(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        else:
            q, k = (l2_normalized(x.float()).repeat_interleave(self.value_heads // self.key_heads, dim=2)
                    for x in (q, k))
            core = gated_delta_rule(q, k, v, g, beta).to(v.dtype)
        gated = self.out_norm(core, z.reshape(b, s, self.value_heads, self.value_head_dim))
        return gated.reshape(b, s, -1)


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


def _sequence_bounds(packed_seq_params: Any, rows: int) -> list[tuple[int, int]]:
    """(start, end) of each packed sequence (cu_seqlens, padded where the framework pads)."""
    cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    cu = packed_seq_params.cu_seqlens_q if cu is None else cu
    edges = [int(x) for x in cu.tolist()]
    if edges[0] != 0 or edges[-1] != rows or any(b < a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"cu_seqlens {edges} do not cover the {rows} packed rows from 0")
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
