"""A context-parallel core attention that runs on CPU (gloo), for megatron-core's local layer spec.

megatron-core serves context parallelism only through Transformer Engine's CUDA attention
("Context parallelism is only supported by TEDotProductAttention!"). `ContextParallelAttention`
takes its place as the `core_attention` submodule: each rank all-gathers the keys and values of
the context-parallel group (the backward sums their gradients over the group and keeps its own
rows), masks causally by each local query's global position (and, for packed `thd` input, its
sequence), and computes softmax attention in fp32. Rows are laid out "zigzag" or "contiguous"
(see `megatron_rl_patches.testing.cp_layout`). Simple, not fast: every rank holds the full
[s_local, s] score matrix. `cp_layer_spec(layout)` is the local GPT spec with it.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_rl_patches.shared_prefix.context_parallel import GatheredStream
from megatron_rl_patches.shared_prefix.kinds.kind import known_as
from megatron_rl_patches.shared_prefix.kinds.plain_cores import PLAIN_CORES
from megatron_rl_patches.testing.cp_layout import check_layout, local_rows


def _cp_group(pg_collection: Any) -> Any:
    group = getattr(pg_collection, "cp", None)
    if group is not None:
        return group

    return parallel_state.get_context_parallel_group()


def _tp_size(pg_collection: Any) -> int:
    group = getattr(pg_collection, "tp", None)
    if group is not None:
        return group.size()

    return parallel_state.get_tensor_model_parallel_world_size()


@known_as(PLAIN_CORES)  # a shared-prefix plan runs it as its plain causal core
class ContextParallelAttention(MegatronModule):
    """`core_attention` for megatron-core's local spec serving context parallelism on CPU.

    Same constructor as megatron-core's `DotProductAttention` (process groups from `pg_collection`
    / `model_comm_pgs`, else megatron's parallel state) plus `layout` ("zigzag" or "contiguous").
    `forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None)`: query [s_local, b, np, hn] (packed: [t_local, np, hn] with the global
    cu_seqlens in `packed_seq_params`); returns [s_local, b, np*hn]. With `attention_mask` None
    the mask is causal (within each packed sequence); a given mask is the global [b or 1, 1, s, s]
    one (True = masked), as the local DotProductAttention at CP=1 would take it.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, model_comm_pgs: Any = None,
                 layout: str = "zigzag", **_: Any) -> None:
        super().__init__(config=config)
        self.layout = check_layout(layout)
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"ContextParallelAttention serves softmax_type='vanilla' only, got {config.softmax_type!r}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("ContextParallelAttention has no sliding window: set config.window_size=None")
        groups = pg_collection if pg_collection is not None else model_comm_pgs
        self.cp_group = _cp_group(groups)
        tp = _tp_size(groups)
        self.heads = config.num_attention_heads // tp
        self.query_groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
        self.attn_mask_type = attn_mask_type
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None,
                **_: Any) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("ContextParallelAttention takes no attention_bias")
        packed = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", "thd") == "thd"
        if packed:  # megatron squeezes the dummy batch of `thd` input: [t, np, hn]
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        cp_size, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        rows_local = query.size(0)
        if packed:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            if int(cu[-1]) != rows_local * cp_size:
                raise ValueError(f"packed_seq_params.cu_seqlens (global) cover {int(cu[-1])} rows; the "
                                 f"{cp_size} context-parallel ranks hold {rows_local * cp_size}")
            where = dict(cu_seqlens=cu)
        else:
            where = dict(length=rows_local * cp_size)
        q_rows = local_rows(self.layout, rank, cp_size, **where)
        k_rows = torch.cat([local_rows(self.layout, r, cp_size, **where) for r in range(cp_size)])
        if cp_size > 1:
            key, value = GatheredStream.apply(key, self.cp_group), GatheredStream.apply(value, self.cp_group)
        allowed = self._allowed(q_rows, k_rows, attention_mask, cu if packed else None).to(query.device)
        repeat = self.heads // self.query_groups
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
        scores = torch.einsum("qbnd,kbnd->bnqk", query.float(), key.float()) * self.softmax_scale
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        probs = self.dropout(torch.softmax(scores, dim=-1))
        context = torch.einsum("bnqk,kbnd->qbnd", probs, value.float()).to(query.dtype)
        return context.reshape(rows_local, context.size(1), self.heads * self.head_dim)

    @staticmethod
    def _allowed(q_rows: torch.Tensor, k_rows: torch.Tensor, attention_mask: Any,
                 cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """[b or 1, 1 or np, sq, sk] True where a query may attend to a key."""
        if attention_mask is not None:
            if cu_seqlens is not None:
                raise ValueError("with packed_seq_params pass attention_mask=None (the mask comes from cu_seqlens)")
            mask = attention_mask.to(torch.bool)
            return ~mask.index_select(-2, q_rows.to(mask.device)).index_select(-1, k_rows.to(mask.device))
        allowed = k_rows[None, :] <= q_rows[:, None]
        if cu_seqlens is not None:
            bounds = cu_seqlens.to(device="cpu", dtype=torch.long)[1:]
            q_seq = torch.bucketize(q_rows, bounds, right=True)
            k_seq = torch.bucketize(k_rows, bounds, right=True)
            allowed &= q_seq[:, None] == k_seq[None, :]
        return allowed[None, None]


def cp_layer_spec(layout: str = "zigzag", spec: Any = None) -> Any:
    """`spec` (default: megatron-core's local GPT layer spec) with `ContextParallelAttention` in
    `layout` as its self-attention's core attention."""
    check_layout(layout)
    if spec is None:
        spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=ContextParallelAttention, params={"layout": layout}
    )
    return spec
