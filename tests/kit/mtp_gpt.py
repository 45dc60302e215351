"""A tiny megatron-core GPTModel with a multi-token prediction block (megatron-core's own MTP
block spec over the kit's packed-input layer spec) on CPU, and one training pass of it as a test
compares it between the packed path and a shared-prefix plan: the main per-token loss, the MTP
loss megatron-core logs per depth, every gradient (the MTP loss's own included)."""
from __future__ import annotations

from typing import Any

import torch

from kit.shared_prefix import PackedBatch


def mtp_takes_packed_input() -> bool:
    """Whether this megatron-core's MTP rolls packed (`thd`) sequences (0.13 asserts it does not)."""
    from megatron.core.transformer import multi_token_prediction

    return hasattr(multi_token_prediction, "_roll_tensor_packed_seq")


def build_mtp_gpt(config: Any, layer_spec: Any = None, seed: int = 3, position_embedding_type: str = "rope",
                  **model_kwargs: Any) -> Any:
    """A real GPTModel of `config` (`mtp_num_layers` set) whose MTP block mirrors `layer_spec`
    (default: the kit's packed-input spec); RoPE, or `position_embedding_type` ("learned_absolute")."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_rl_patches.testing.megatron_cpu import TINY_VOCAB
    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    spec = layer_spec if layer_spec is not None else packed_gpt_spec(getattr(config, "num_moe_experts", None))
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=TINY_VOCAB, max_sequence_length=512,
                     position_embedding_type=position_embedding_type,
                     mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False), **model_kwargs)
    return model.to(config.params_dtype)


def mtp_pass(model: Any, batch: PackedBatch, route: Any, loss_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """One training pass: the main per-token loss of the sample rows, the MTP loss per depth as
    megatron-core logs it, and every gradient (the MTP loss reaches them through its autoscaler)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_rl_patches.testing.compare import collect_grads

    MTPLossLoggingHelper.tracker.clear()  # sized by the first model's depth: made again per pass
    model.train()
    losses = route(model, batch, labels=batch.labels, loss_mask=loss_mask)[0, batch.rows]
    weights = torch.linspace(-1.0, 2.0, losses.numel(), dtype=losses.dtype)
    (losses * weights).sum().backward()
    tracker = MTPLossLoggingHelper.tracker  # 0.19 names the loss "loss_values"
    return {"loss": losses.detach(), "mtp": tracker.get("values", tracker.get("loss_values")).clone(),
            "grads": collect_grads(model)}


def layer_rows(model: Any) -> tuple[list[int], list]:
    """The rows each MTP depth's transformer layer computes in a pass (filled as it runs), its hooks."""
    seen: list[int] = []
    inner = [getattr(layer, "transformer_layer", None) or layer.mtp_model_layer  # 0.19's name
             for layer in model.mtp.layers]
    hooks = [module.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(int(kwargs["hidden_states"].shape[0])), with_kwargs=True)
        for module in inner]
    return seen, hooks


def distinct_mtp_rows(batch: PackedBatch, depth: int, pad_to: int = 1) -> int:
    """The rows depth `depth` computes once each: per row t of a sample, its tokens 0..t + depth (rows
    of samples agreeing there are one); a row past its sample's end by then is its own; the padding
    packed as one sequence of its own; padded to a multiple of `pad_to` (the sequence-parallel ranks)."""
    ahead = {tuple(s[:t + depth + 1]) for s in batch.sequences for t in range(len(s) - depth)}
    own = sum(min(depth, len(s)) for s in batch.sequences)
    rows = len(ahead) + own + batch.tokens.size(1) - sum(batch.lengths)
    return rows + -rows % pad_to
