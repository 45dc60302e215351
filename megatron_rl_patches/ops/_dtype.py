"""The dtype the vocabulary ops compute in (a leaf: every ops module may import it)."""
from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the math runs in: fp64 for fp64 inputs, fp32 for every other float."""
    return torch.float64 if dtype == torch.float64 else torch.float32
