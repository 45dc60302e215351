"""A tiny GPTModel with multi-token-prediction (MTP) heads for CPU tests: megatron-core's local layer
spec and its MTP block spec (`get_gpt_mtp_block_spec`, no Transformer Engine), `mtp_num_layers`
depths. megatron-core >= 0.18 computes the heads' loss in `process_mtp_loss` (patch
`mtp_output_processor` routes it through the fused head); before 0.18 the forward computes it
inline (the `gpt_output_processor` backport serves it). Before 0.18 the forward needs `labels`
whenever MTP is configured (megatron reads `labels.clone()`)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.testing.megatron_cpu import TINY_SEQ, TINY_VOCAB, tiny_gpt_config


def tiny_mtp_config(mtp_num_layers: int = 2, mtp_loss_scaling_factor: float = 0.3, **overrides: Any) -> Any:
    """`tiny_gpt_config` with `mtp_num_layers` MTP depths whose loss is scaled by `mtp_loss_scaling_factor`."""
    return tiny_gpt_config(mtp_num_layers=mtp_num_layers, mtp_loss_scaling_factor=mtp_loss_scaling_factor,
                           **overrides)


def build_tiny_mtp_gpt(config: Any = None, *, vocab_size: int = TINY_VOCAB, seq_length: int = TINY_SEQ,
                       pre_process: bool = True, post_process: bool = True, seed: int | None = 0,
                       share_embeddings_and_output_weights: bool = False) -> Any:
    """A real GPTModel with MTP heads (config default: `tiny_mtp_config()`); `seed` fixes the weights."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = config if config is not None else tiny_mtp_config()
    if not getattr(config, "mtp_num_layers", None):
        raise ValueError("build_tiny_mtp_gpt needs a config with mtp_num_layers set (see tiny_mtp_config)")
    spec = get_gpt_layer_local_spec()
    if seed is not None:
        torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size, max_sequence_length=seq_length,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                    mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))


def tiny_mtp_provider(config: Any = None, **kwargs: Any) -> Callable[..., Any]:
    """A Megatron-LM style `model_provider(pre_process, post_process, vp_stage=None)` of MTP GPTs
    (pipeline parallelism 1: `vp_stage` must be None); keywords as `build_tiny_mtp_gpt`."""

    def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> Any:
        if vp_stage is not None:
            raise ValueError("tiny_mtp_provider builds pipeline parallelism 1 only: vp_stage must be None")
        return build_tiny_mtp_gpt(config, pre_process=pre_process, post_process=post_process, **kwargs)

    return model_provider
