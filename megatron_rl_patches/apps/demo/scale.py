"""The demo's savings at the size of real models, through the formulas the package documents:
`training_state_bytes` (what `megatron-rl-patches memory` prints) for each inference-only teacher,
and T·V·bytes for the logits the fused output processors never allocate."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.inference.sizing.memory import training_state_bytes


@dataclass(frozen=True)
class RealModel:
    name: str
    params: int
    vocab: int
    vocab_from: str  # whose vocabulary size


REAL_MODELS = (
    RealModel("8B", 8_190_000_000, 151_936, "Qwen3-8B"),
    RealModel("32B", 32_800_000_000, 151_936, "Qwen3-32B"),  # a family build_inference_model_from_hf serves
)
# (data-parallel size, distributed optimizer): one GPU, and one node of 8 with the optimizer sharded.
LAYOUTS = ((1, False), (8, True))
TOKENS_PER_MICROBATCH = 16_384  # per rank, tensor parallelism 1
LOGITS_BYTES = 2  # bf16
FUSED_BYTES = 4  # fp32 top-k bucket log-probs and tail


def teacher_rows(teachers: int) -> list[dict[str, Any]]:
    """Per rank: what `teachers` trainable builds would hold beyond their weights (bf16 weights,
    fp32 grads, Adam), i.e. what inference-only builds save."""
    rows = []
    for model in REAL_MODELS:
        for dp, distributed in LAYOUTS:
            state = training_state_bytes(model.params, dp=dp, distributed_optimizer=distributed,
                                         param_dtype="bf16", grad_dtype="fp32")
            rows.append({"model": model.name, "params": model.params, "dp": dp, "distributed_optimizer": distributed,
                         "per_teacher_bytes": state.total, "saved_bytes": teachers * state.total})
    return rows


def logits_rows(teachers: int, topk: int, tokens: int = TOKENS_PER_MICROBATCH) -> list[dict[str, Any]]:
    """Per rank and micro-batch: bf16 [T, V] logits of the actor and of each teacher's forward
    (the logits route), against the fused route's per-model O(T·k) outputs (fp32 buckets + tail)."""
    rows = []
    for model in REAL_MODELS:
        one = tokens * model.vocab * LOGITS_BYTES
        rows.append({"model": model.name, "params": model.params, "vocab": model.vocab, "vocab_from": model.vocab_from,
                     "tokens": tokens,
                     "actor_logits_bytes": one, "teacher_logits_bytes": teachers * one,
                     "topk": topk, "fused_bytes_per_model": tokens * (topk + 1) * FUSED_BYTES})
    return rows
