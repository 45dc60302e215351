"""Stand-in for slime's model_provider: get_model_provider_func(args, role) returns a Megatron-LM
style provider (here a tiny GPT on CPU)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def get_model_provider_func(args: Any, role: str = "actor") -> Callable[..., Any]:
    def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> Any:
        import torch

        from megatron_rl_patches.testing.megatron_cpu import build_tiny_gpt, tiny_gpt_config

        dtype = torch.bfloat16 if args.bf16 else torch.float32
        config = tiny_gpt_config(bf16=args.bf16, params_dtype=dtype, pipeline_dtype=dtype)
        return build_tiny_gpt(config, pre_process=pre_process, post_process=post_process, seed=args.seed)

    return model_provider
