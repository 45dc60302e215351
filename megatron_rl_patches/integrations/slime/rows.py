"""Which packed rows are slime's responses, their targets, and per-sample slices of per-token
results: slime's own helpers from its loss module (624b824a), so thd packing, zigzag and
allgather context parallelism are sliced exactly as slime slices its logits."""
from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

from megatron_rl_patches.ops.packing import positions_mask

LOSS = "slime.backends.megatron_utils.loss"
HELPERS = ("_build_shifted_tokens", "_extract_per_sample", "_allgather_cp_redistribute", "slice_log_prob_with_cp")


def slime_loss() -> Any:
    """slime's loss module, with the helpers the fused route slices with."""
    module = sys.modules.get(LOSS)
    if module is None:
        module = importlib.import_module(LOSS)
    missing = [name for name in HELPERS if not hasattr(module, name)]
    if missing:
        raise RuntimeError(f"slime_fused: this slime's {LOSS} lacks {missing} (written for slime 624b824a)")
    return module


def shifted_targets(batch: dict, length: int, device: Any, allgather_cp: bool) -> torch.Tensor:
    """[T] next-token targets in the micro-batch's local layout, as slime builds them."""
    return slime_loss()._build_shifted_tokens(length, device, batch["unconcat_tokens"], batch["total_lengths"],
                                              batch["response_lengths"], allgather_cp)


def response_positions(batch: dict, length: int, device: Any, allgather_cp: bool) -> list[torch.Tensor]:
    """Per sample, the local row indices slime's slicing reads for its response."""
    positions = torch.arange(length, device=device)
    pieces, _ = slime_loss()._extract_per_sample(positions, None, batch["total_lengths"], batch["response_lengths"],
                                                 allgather_cp)
    return list(pieces)


def response_rows(batch: dict, length: int, device: Any, allgather_cp: bool) -> torch.Tensor:
    """[T] bool: the local rows slime's slicing reads (every response token, loss-masked or not)."""
    return positions_mask(response_positions(batch, length, device, allgather_cp), length, device)


def per_sample(output: dict, args: Any, total_lengths: list[int], response_lengths: list[int],
               with_entropy: bool, key: str = "log_probs") -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """slime's `get_log_probs_and_entropy` result from the processor's [1, T] log-probs (`key`:
    "kept_log_probs" for top-p replay) and entropy."""
    loss = slime_loss()
    log_probs = output[key].reshape(-1)
    entropy = output.get("entropy")
    if with_entropy and entropy is None:
        raise RuntimeError("slime_fused: entropy was asked of a forward pass run without it; please report this")
    allgather_cp = bool(getattr(args, "allgather_cp", False))
    entropy_rows = entropy.reshape(-1) if with_entropy and entropy is not None else None
    log_prob_list, entropy_list = loss._extract_per_sample(log_probs, entropy_rows, total_lengths, response_lengths,
                                                           allgather_cp)
    result = {"log_probs": log_prob_list}
    if with_entropy:
        result["entropy"] = entropy_list
    if allgather_cp:
        loss._allgather_cp_redistribute(result, logits_local_len=log_probs.numel(), total_lengths=total_lengths,
                                        response_lengths=response_lengths)
    return torch.empty((0,), device=log_probs.device), result
