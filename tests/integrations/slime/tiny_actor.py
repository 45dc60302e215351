"""slime's actor arguments as the teachers' loading reads them, of tiny_hf_config("qwen3")'s shape
(a teacher of another number of layers is then of another architecture)."""
from __future__ import annotations

from argparse import Namespace
from typing import Any

import torch

from megatron_rl_patches.integrations.slime.opd_settings import LOSS_PATH


def tiny_actor_args(**overrides: Any) -> Namespace:
    values: dict[str, Any] = dict(
        hidden_size=32, num_layers=2, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
        kv_channels=8, ffn_hidden_size=48, num_experts=None, vocab_size=1001, qk_layernorm=True, add_qkv_bias=False,
        untie_embeddings_and_output_weights=True, loss_type="custom_loss", custom_loss_function_path=LOSS_PATH,
        context_parallel_size=1, allgather_cp=False, transformer_impl="local", params_dtype=torch.float32,
        hf_checkpoint="none")
    values.update(overrides)
    return Namespace(**values)
