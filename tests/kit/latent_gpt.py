"""A tiny megatron-core GPTModel with multi-latent attention (MLASelfAttention: low-rank query and
key/value latents, a rotary part of its own, values narrower than queries and keys) that takes
packed (`thd`) input on CPU: megatron-core's local MLA layer spec with the kit's packed core."""
from __future__ import annotations

from typing import Any

import torch

MLA = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=6, normalization="RMSNorm", qk_layernorm=True)
# YaRN as DeepSeek-V3 sets it (a factor > 1 with mscale_all_dim: the softmax scale is MLA's own, not 1/sqrt(d))
YARN = dict(rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0)


def mla_takes_packed_input() -> bool:
    """Whether this megatron-core's MLA runs packed (`thd`) input on CPU: 0.13.1's fails inside its
    rotary step (checked); 0.16.1 and 0.19.2 run it."""
    from megatron.core.package_info import __version__

    return tuple(int(part) for part in __version__.split(".")[:2]) >= (0, 16)


def tiny_mla_config(rope_type: str = "yarn", dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """MLATransformerConfig of 2 layers, hidden 32, 4 heads (query/key width 8 + 4 rotary, value 6),
    weights drawn wide enough (std 0.2) that a rotary table read at the wrong positions shows."""
    from dataclasses import fields

    from megatron.core.transformer.transformer_config import MLATransformerConfig

    rope: dict[str, Any] = dict(YARN) if rope_type == "yarn" else dict(rope_type="rope")
    if rope_type == "yarn":  # megatron-core 0.13 names it max_position_embeddings
        names = {f.name for f in fields(MLATransformerConfig)}
        original = "original_max_position_embeddings"
        rope[original if original in names else "max_position_embeddings"] = 64
    values: dict[str, Any] = dict(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                  hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype,
                                  init_method_std=0.2,  # the rotary part weighs in the scores
                                  **MLA, **rope)
    values.update(overrides)
    return MLATransformerConfig(**values)


def build_mla_gpt(config: Any, seq_length: int = 512, seed: int = 3, context_parallel_layout: str | None = None,
                  **model_kwargs: Any) -> Any:
    """A real GPTModel of `config` (an MLA config) with the packed-input core attention stand-in (the
    kit's CPU context-parallel core in `context_parallel_layout` where given)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_rl_patches.inference.loading.hf.families.mla import disarm_mocked_te_in_mla
    from megatron_rl_patches.testing.megatron_cpu import TINY_VOCAB
    from megatron_rl_patches.testing.packed_gpt import packed_attention_class

    disarm_mocked_te_in_mla()
    spec = get_gpt_layer_local_spec(num_experts=getattr(config, "num_moe_experts", None), moe_grouped_gemm=False,
                                    multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = packed_attention_class()
    if context_parallel_layout is not None:
        from megatron_rl_patches.testing.cp_attention import cp_layer_spec

        spec = cp_layer_spec(context_parallel_layout, spec)
    if getattr(config, "mtp_num_layers", None):  # DeepSeek-V3's MTP: the block mirrors the MLA layer
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        model_kwargs["mtp_block_spec"] = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=TINY_VOCAB, max_sequence_length=seq_length,
                     position_embedding_type="rope", **model_kwargs)
    return model.to(config.params_dtype)
