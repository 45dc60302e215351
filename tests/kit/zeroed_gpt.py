"""A tiny packed GPTModel whose hidden states are a function of the token alone: every layer's
output projections zeroed (each layer adds zero to the residual stream: hidden = norm(embedding)),
so a framework's fused route gives batch-invariant rows on CPU wherever its vocabulary op does (the
layers' own invariance is megatron-core's batch_invariant_mode on a GPU, not this package's:
docs/train-rollout-agreement.md). The slime and verl invariant-mode tests build it."""
from __future__ import annotations

from typing import Any

import torch


def zeroed_output_gpt(vocab_size: int, seq_length: int, hidden_size: int = 128, seed: int = 2) -> Any:
    """The kit's packed GPTModel (one layer, 4 heads, RoPE; `seq_length` positions), in eval mode,
    its layers' `linear_proj` and `linear_fc2` weights zeroed."""
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    model = build_packed_gpt(vocab_size=vocab_size, seq_length=seq_length, seed=seed, hidden_size=hidden_size,
                             num_attention_heads=4, num_layers=1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "linear_proj" in name or "linear_fc2" in name:
                parameter.zero_()
    return model.eval()
