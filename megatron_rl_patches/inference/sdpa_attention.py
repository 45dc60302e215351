"""A causal attention core on torch's scaled_dot_product_attention, for megatron-core's
multi-latent attention without Transformer Engine: MLA gives its core attention key and value
widths of their own (`k_channels` / `v_channels`), which megatron-core's local DotProductAttention
does not take. It holds no weights, so a spec may swap it for Transformer Engine's."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl_patches.model.attention_layout import heads_first, kv_heads_repeated, sequence_first
from megatron_rl_patches.shared_prefix.kinds.kind import known_as
from megatron_rl_patches.shared_prefix.kinds.plain_cores import PLAIN_CORES


@known_as(PLAIN_CORES)  # a shared-prefix plan runs it as its plain causal core
class SDPACoreAttention(torch.nn.Module):
    """Causal softmax attention of [s, b, heads, d] queries, keys and values (values may be another
    width) with the softmax scale megatron passes (default 1/sqrt(key width)); returns [s, b, heads*dv]."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: Any = None,
                 pg_collection: Any = None, **unused: Any) -> None:
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention serves causal self-attention only, got {attn_mask_type}")
        if getattr(config, "context_parallel_size", 1) > 1:
            raise ValueError("SDPACoreAttention serves context-parallel size 1 only; use Transformer Engine's "
                             "TEDotProductAttention for context parallelism")
        self.config, self.layer_number = config, layer_number  # as megatron-core's cores keep them (read by seams)
        self.softmax_scale = softmax_scale
        self.dropout = float(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, packed_seq_params: Any = None, **unused: Any) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention does not serve packed (thd) batches; pass core_attention= "
                             "Transformer Engine's TEDotProductAttention where a framework packs sequences")
        q, k, v = heads_first(query, key, value)
        k, v = (kv_heads_repeated(t, q.shape[1], "SDPACoreAttention") for t in (k, v))
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        if attention_mask is not None:  # megatron's masks are True where a position is hidden
            mask = mask & ~attention_mask.to(torch.bool)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale,
                                             dropout_p=self.dropout if self.training else 0.0)
        return sequence_first(out)
