"""slime's actor as the teachers' loading reads it (`tiny_actor_args`: its arguments; `TinyActor`:
them, its model, the snapshot loader, logged, and the switch), of tiny_hf_config("qwen3")'s shape
(a teacher of another number of layers is then of another architecture)."""
from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace
from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd.opd_settings import LOSS_PATH


def tiny_actor_args(**overrides: Any) -> Namespace:
    values: dict[str, Any] = dict(
        hidden_size=32, num_layers=2, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
        kv_channels=8, ffn_hidden_size=48, num_experts=None, vocab_size=1001, qk_layernorm=True, add_qkv_bias=False,
        untie_embeddings_and_output_weights=True, loss_type="custom_loss", custom_loss_function_path=LOSS_PATH,
        context_parallel_size=1, allgather_cp=False, transformer_impl="local", params_dtype=torch.float32,
        hf_checkpoint="none")
    values.update(overrides)
    return Namespace(**values)


class TinyActor:
    """What load_teachers reads of slime's actor: args, model (vocab padded to 1024), the snapshot
    loader (each path it is asked for logged in `loaded`) and the model switch."""

    def __init__(self, **overrides: Any):
        self.args = tiny_actor_args(**overrides)
        self.model = [SimpleNamespace(vocab_size=1024, config=SimpleNamespace())]
        self.loaded: list[str] = []

    def load_other_checkpoint(self, tag: str, path: str) -> None:
        self.loaded.append(path)

    def _switch_model(self, tag: str) -> None:
        pass
