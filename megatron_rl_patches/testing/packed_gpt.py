"""A tiny GPTModel that takes packed (`thd`) input on CPU, as frameworks feed it (verl's engine
packs every micro-batch). megatron-core's local DotProductAttention refuses `packed_seq_params`
(only Transformer Engine's CUDA attention takes them); this test-only stand-in masks attention
to stay causal within each packed sequence and otherwise runs megatron's own code."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.inference.sdpa_attention import SDPACoreAttention
from megatron_rl_patches.model.attention_layout import with_batch
from megatron_rl_patches.shared_prefix.kinds.kind import known_as
from megatron_rl_patches.shared_prefix.kinds.plain_cores import PLAIN_CORES
from megatron_rl_patches.testing.megatron_cpu import TINY_VOCAB, tiny_gpt_config


def packed_attention_class() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    @known_as(PLAIN_CORES)  # a shared-prefix plan runs it as its plain causal core
    class PackedDotProductAttention(DotProductAttention):
        """DotProductAttention with packed sequences: a block-diagonal causal mask from cu_seqlens.
        Like Transformer Engine's core it takes multi-latent attention's own key / value widths
        (`k_channels` / `v_channels`, which megatron-core's local core refuses): those layers run
        the library's SDPA core under the same mask."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type="self", attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, **kwargs: Any):
            super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
                             **kwargs)
            self.latent = None
            if k_channels is not None or v_channels is not None:
                self.latent = SDPACoreAttention(config, layer_number, attn_mask_type, attention_type,
                                                attention_dropout, softmax_scale)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs: Any):
            squeezed = False
            if packed_seq_params is not None:
                cu = packed_seq_params.cu_seqlens_q_padded
                cu = packed_seq_params.cu_seqlens_q if cu is None else cu
                rows = query.size(0)
                lengths = cu.diff().to(torch.long)
                sequence = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
                if sequence.numel() != rows:
                    raise ValueError(f"cu_seqlens cover {sequence.numel()} rows, the packed input has {rows}")
                causal = torch.ones(rows, rows, dtype=torch.bool).tril()
                attention_mask = ~(causal & (sequence[:, None] == sequence[None, :]))[None, None]
                squeezed = query.dim() == 3  # megatron squeezes the dummy batch of `thd` input: [t, np, hn]
                query, key, value = with_batch(query, key, value)
            if self.latent is not None:
                out = self.latent(query, key, value, attention_mask)
                # packed input as Transformer Engine answers it, [t, heads * dv]: megatron-core >= 0.19's MLA pads
                # the values of `thd` input to the query's width and trims the heads of a 2-D output back
                return out.squeeze(1) if squeezed else out
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None, **kwargs)

    return PackedDotProductAttention


def packed_gpt_spec(num_experts: int | None = None) -> Any:
    """megatron-core's local GPT layer spec with the packed-input attention stand-in (an MoE MLP
    of `num_experts` SequentialMLP experts when given)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    spec.submodules.self_attention.submodules.core_attention = packed_attention_class()
    return spec


def _cp_spec(layout: str, num_experts: int | None = None) -> Any:
    # lazy: optional dependency megatron-core (through this module)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_rl_patches.testing.cp_attention import cp_layer_spec

    return cp_layer_spec(layout, get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False))


def build_packed_gpt(vocab_size: int = TINY_VOCAB, seq_length: int = 64, seed: int = 0, config: Any = None,
                     share_embeddings: bool = False, pre_process: bool = True, post_process: bool = True,
                     context_parallel_layout: str | None = None, vp_stage: int | None = None,
                     position_embedding_type: str = "rope", **config_overrides: Any) -> Any:
    """A real GPTModel (RoPE, like the models verl trains) that accepts packed `thd` input on CPU;
    `pre_process` / `post_process` / `vp_stage` as Megatron's model providers pass them to a
    pipeline stage (and virtual stage);
    `context_parallel_layout` ("zigzag" / "contiguous"): the kit's CPU context-parallel attention
    (megatron-core's `thd` RoPE cuts each sequence in zigzag: a "contiguous" model takes
    `position_embedding_type="none"`, as slime's allgather-CP models bring their own positions)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    experts = getattr(config, "num_moe_experts", None)
    spec = packed_gpt_spec(experts) if context_parallel_layout is None else _cp_spec(context_parallel_layout, experts)
    return GPTModel(
        config=config if config is not None else tiny_gpt_config(**config_overrides),
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        position_embedding_type=position_embedding_type,
        share_embeddings_and_output_weights=share_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )


def make_packed_batch(lengths: list[int], vocab_size: int = TINY_VOCAB, seed: int = 0) -> dict:
    """Sequences of `lengths` packed into one `thd` stream: tokens, labels, position_ids [1, T]
    (positions restart at each sequence), attention_mask None, packed_seq_params (cu_seqlens)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of ints >= 1, got {lengths!r}")
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (1, sum(lengths) + 1), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "attention_mask": None,
        "packed_seq_params": params,
    }
