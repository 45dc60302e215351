"""The inference builds of one provider in every residency mode, one at a time (a test scores each
against the trainable model's values)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


def each_residency(provider: Callable[..., Any]) -> Iterator[tuple[str, list[Any]]]:
    """(mode, chunks) of `build_inference_model(provider, residency=mode)` for resident, swap, stream."""
    from megatron_rl_patches.inference import RESIDENCY_MODES, build_inference_model

    for mode in RESIDENCY_MODES:
        yield mode, build_inference_model(provider, residency=mode)
