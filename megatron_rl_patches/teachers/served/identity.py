"""Whether two servers are replicas of one teacher (`difference`): by what they compute, not by
the path they were started from. Each engine scores a fixed probe at connect (`ServedModel.answer`);
two replicas agree when their answers agree within the tolerance of the engine's kind:

- rows (prompt log-probs): every log-prob of the probe (the actual token's, the top-k values)
  within `ROWS_NATS` = 1e-3 nats. Two float32 servers of one checkpoint agree to ~1e-5 (batched
  apart); the same weights served in bf16 miss by ~1e-2, another checkpoint by nats: an fp32 and
  a bf16 server are two teachers.
- hidden states: the mean absolute difference within `STATES_RELATIVE` = 1e-3 of the states' mean
  size, or the precision the states travel in where that is coarser (bf16: 2^-7; fp8: 2^-3 or 2^-2).

The served model's name may differ (vLLM names a model by the path it was started from, and a copy
at another path is the same teacher: each replica is asked by its own name); its max model length
and what a request generates must not (a sample must fit every replica)."""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.teachers.served.engines.protocol import STATES, ServedModel

ROWS_NATS = 1e-3
STATES_RELATIVE = 1e-3


def difference(kind: str, reference: ServedModel, other: ServedModel) -> str | None:
    """How `other` differs from `reference` as a replica of one teacher (None: it does not), in words
    that follow 'replica X ', naming the reference's replica `{reference}` (see the module's words)."""
    if (other.max_model_len, other.generates) != (reference.max_model_len, reference.generates):
        return f"serves {described(other)}, but replica {{reference}} serves {described(reference)}"
    if reference.answer is None or other.answer is None:
        return None
    if kind == STATES:
        return states_difference(reference.answer, other.answer)
    return rows_difference(reference.answer, other.answer)


def rows_difference(reference: Any, other: Any) -> str | None:
    pairs = [(reference.token_log_probs, other.token_log_probs), (reference.topk_log_probs, other.topk_log_probs)]
    if any(a.shape != b.shape for a, b in pairs):
        return "scores the probe in other shapes than replica {reference}"
    worst = max((float((a.double() - b.double()).abs().max()) for a, b in pairs if a.numel()), default=0.0)
    if not worst <= ROWS_NATS:  # NaN included
        return f"scores the probe other than replica {{reference}}: its log-probs are off by {worst:.3g} nats, " \
               f"beyond {ROWS_NATS:g} (another checkpoint, or the same in another precision)"
    return None


def states_difference(reference: torch.Tensor, other: torch.Tensor) -> str | None:
    if reference.shape != other.shape:
        return f"computes the probe's hidden states other than replica {{reference}}: shape {tuple(other.shape)} " \
               f"against {tuple(reference.shape)}"
    a, b = reference.double(), other.double()
    size = float(a.abs().mean())
    off = float((a - b).abs().mean()) / size if size else float((a - b).abs().mean())
    tolerance = max(STATES_RELATIVE, torch.finfo(reference.dtype).eps)
    if not off <= tolerance:
        return f"computes the probe's hidden states other than replica {{reference}}: off by {off:.3g} of their " \
               f"mean size, beyond {tolerance:g} (another checkpoint, or the same in another precision)"
    return None


def described(model: ServedModel) -> str:
    root = "" if model.root is None else f", root {model.root!r}"
    return f"model {model.name!r}{root}, max model length {model.max_model_len}"
