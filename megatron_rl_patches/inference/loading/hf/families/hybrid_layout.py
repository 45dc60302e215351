"""Qwen3.5 / Qwen3-Next tensors in megatron-core's layouts (families/qwen3_5.py, qwen3_next.py):
the gated q_proj ([query, gate] per head) fused with k/v per query group as `attention_output_gate`
wants ([queries, gates, key, value] per group); the gated delta net's projections and convolution
arranged per tensor-parallel rank ([q, k, v, z, b, a] of the rank's heads); Qwen3-Next's per-key-head
fused projections taken apart first."""
from __future__ import annotations

import torch

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture


def gated_qkv(arch: HFArchitecture, q_proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              repeat: int = 1) -> torch.Tensor:
    """linear_qkv with the output gate: per query group its queries, their gates, its key and value;
    `repeat`: each key/value head repeated for that many query groups (kv_heads.py)."""
    groups, hd = arch.num_kv_heads, arch.head_dim
    tail = q_proj.shape[1:]
    per_head = q_proj.reshape(arch.num_heads, 2, hd, *tail)
    query, gate = (per_head[:, i].reshape(groups * repeat, -1, *tail) for i in (0, 1))
    kv = [x.reshape(groups, hd, *tail).repeat_interleave(repeat, dim=0) for x in (k, v)]
    parts = [query, gate, *kv]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _qkv_rows(arch: HFArchitecture, qkv: torch.Tensor) -> list[torch.Tensor]:
    m = arch.linear
    return list(torch.split(qkv, [m.key_width, m.key_width, m.value_width], dim=0))


def linear_in_proj(arch: HFArchitecture, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, *,
                   rank: int, size: int) -> torch.Tensor:
    """This rank's in_proj rows: its share of q, k, v, z, b and a (contiguous blocks of heads)."""
    return torch.cat([part.chunk(size, dim=0)[rank] for part in [*_qkv_rows(arch, qkv), z, b, a]], dim=0)


def linear_conv(arch: HFArchitecture, weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's conv1d channels: its share of the q, k and v channels."""
    return torch.cat([part.chunk(size, dim=0)[rank] for part in _qkv_rows(arch, weight)], dim=0)


def unfuse_qkvz_ba(arch: HFArchitecture, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Qwen3-Next's in_proj_qkvz ([q, k, v, z] per key head) and in_proj_ba ([b, a] per key head) as
    Qwen3.5's in_proj_qkv ([all q, all k, all v]), in_proj_z, in_proj_b and in_proj_a."""
    m = arch.linear
    per_key = m.value_heads // m.key_heads
    tail = qkvz.shape[1:]
    q, k, v, z = torch.split(qkvz.reshape(m.key_heads, -1, *tail),
                             [m.key_head_dim, m.key_head_dim, per_key * m.value_head_dim, per_key * m.value_head_dim],
                             dim=1)
    b, a = torch.split(ba.reshape(m.key_heads, 2 * per_key, *tail), [per_key, per_key], dim=1)
    flat = [x.reshape(-1, *tail) for x in (q, k, v, z, b, a)]
    return torch.cat(flat[:3], dim=0), flat[3], flat[4], flat[5]
