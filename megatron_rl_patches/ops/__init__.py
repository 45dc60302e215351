"""The vocabulary ops: per-token log-probs, entropy, top-k buckets and divergences over
vocab-parallel logits, or straight from the final hidden states and the output weight (the fused
LM head), at the memory floor. Importing this package is cheap; each op loads on first use.

- on logits [T, V_local]: :func:`log_probs_and_entropy`, :func:`topk_ids`, :func:`topk_logprobs`,
  :func:`topk_opd_loss`; on computed buckets: :func:`topk_kl`, :func:`union_ids`;
- the fused LM head (hidden [T, H], weight [V_local, H]): :func:`lm_head_log_probs_and_entropy`,
  :func:`lm_head_topk_ids`, :func:`lm_head_topk_logprobs`, :func:`lm_head_divergence`;
- what every score of a step is computed with, made once and passed down: :class:`ScoringPlan`
  (K or the whole vocabulary, :data:`VOCAB`; the temperature; the invariant mode);
- modules: :mod:`.packing` (packed sequences and context parallelism), :mod:`.checkpoint`
  (activation checkpointing of a loss), :mod:`.kernels` (the backends and their contract).
"""
from __future__ import annotations

from megatron_rl_patches._lazy import lazy_getattr, lazy_names

# module: the public names it defines (each resolved on first access)
_LAZY = lazy_names("""
    logprobs: log_probs_and_entropy
    topk: topk_ids topk_logprobs topk_opd_loss topk_kl union_ids
    lm_head: lm_head_log_probs_and_entropy lm_head_topk_ids lm_head_topk_logprobs
    divergence: lm_head_divergence
    scoring_plan: ScoringPlan VOCAB
""")

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted([*_LAZY, "checkpoint", "kernels", "packing"])
