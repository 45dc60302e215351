"""The tail bucket from a teacher's top-k log-probs: log(1 - sum_k p) in float64, clamped."""
from __future__ import annotations

import math

import torch

from megatron_rl_patches.ops.topk import log1mexp

# The mass left outside the top-k is floored at float32's epsilon: engines send fp32 values, so a
# smaller mass (a tail below ~1e-6) is rounding noise, and a sum that rounds to >= 1 stays finite.
TAIL_MASS_FLOOR = torch.finfo(torch.float32).eps


def tail_log_probs(topk_log_probs: torch.Tensor) -> torch.Tensor:
    """[R, K] top-k log-probs -> [R] log(1 - sum_k exp(l)) in float64, the mass floored at
    `TAIL_MASS_FLOOR`."""
    covered = torch.logsumexp(topk_log_probs.to(torch.float64), dim=-1).clamp(max=0.0)
    return log1mexp(covered).clamp(min=math.log(TAIL_MASS_FLOOR))
