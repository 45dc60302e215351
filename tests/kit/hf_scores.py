"""Per-token log-probs of a Hugging Face checkpoint two ways, for the family reference tests: the
package's build (its fused log-prob head) and transformers' own forward, both as float64 [B, S]."""
from __future__ import annotations

from typing import Any

import torch


def built_log_probs(chunk: Any, batch: dict, vocab: int) -> torch.Tensor:
    """log p(label) from a built model chunk over its first `vocab` ids."""
    from megatron_rl_patches import log_prob_output_processor

    with torch.no_grad():
        return chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                     output_processor=log_prob_output_processor(vocab_size=vocab))["log_probs"].double()


def transformers_log_probs(model: Any, batch: dict) -> torch.Tensor:
    """log p(label) from transformers' forward of `model` (its logits in float64)."""
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=batch["tokens"]).logits.double(), dim=-1)
    return full.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
