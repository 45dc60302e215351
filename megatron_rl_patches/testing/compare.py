"""Comparisons a test of a pipeline makes against its reference: the largest difference relative to
the reference's scale, parameter gradients collected (and zeroed) by name, and their worst error."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def relative_error(got: Any, want: Any, floor: float = 1.0) -> float:
    """Largest |got - want| over the reference's largest magnitude (at least `floor`; 0.0: none)."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    return float((got - want).abs().max()) / max(floor, scale) if got.numel() else 0.0


def close(got: Any, want: Any, rel: float, floor: float = 1.0) -> bool:
    """Same shape, and `relative_error` within `rel` (an empty reference: a rank without rows)."""
    return tuple(got.shape) == tuple(want.shape) and relative_error(got, want, floor) <= rel


def collect_grads(model: Any, zero: bool = True, summed_over: Any = None) -> dict[str, Any]:
    """{name: a copy of the gradient} of the parameters that have one, summed over the process group
    `summed_over` when given (e.g. the context-parallel ranks); `zero` sets them to None after."""
    out = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            out[name] = param.grad.clone()
            if summed_over is not None:
                dist.all_reduce(out[name], group=summed_over)
    if zero:
        model.zero_grad(set_to_none=True)
    return out


def grad_error(got: dict[str, Any], want: dict[str, Any], floor: float = 1.0) -> float:
    """The worst `relative_error` over the gradients of the same (non-empty) set of parameters."""
    if not want or got.keys() != want.keys():
        raise ValueError(f"grad_error: the gradients name other parameters: got {sorted(got)}, want {sorted(want)}")
    return max(relative_error(got[name], want[name], floor) for name in want)
