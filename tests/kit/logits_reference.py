"""What the output processors compute, from the logits rows instead (the reference a processor test
compares with): log-probs and entropy, top-k buckets at the rows' own top-k ids, a dense JSD."""
from __future__ import annotations

from typing import Any


def from_logits(which: str, rows: Any, labels: Any, k: int, *, teacher_rows: Any = None, tp_group: Any = None,
                temperature: float = 1.0) -> tuple[Any, ...]:
    """"log-prob": (log-probs, entropy); "top-k": (the k log-probs, the tail, the ids); "divergence":
    (the float64 JSD at beta 0.4 against the whole-vocabulary `teacher_rows`, with `rows` whole too)."""
    from megatron_rl_patches import log_probs_and_entropy, topk_ids, topk_logprobs
    from megatron_rl_patches.testing.divergence_reference import dense_divergence

    if which == "log-prob":
        return log_probs_and_entropy(rows, labels, tp_group=tp_group, temperature=temperature, with_entropy=True)
    if which == "top-k":
        ids = topk_ids(rows.detach() / temperature if temperature != 1.0 else rows.detach(), k, tp_group=tp_group)
        log_probs, tail = topk_logprobs(rows, ids, tp_group=tp_group, temperature=temperature)
        return log_probs, tail, ids
    if which == "divergence":
        return (dense_divergence(rows.double(), [teacher_rows.double()], divergence="jsd", beta=0.4,
                                 temperature=temperature),)
    raise ValueError(f"which must be 'log-prob', 'top-k' or 'divergence', got {which!r}")
