"""Top-k buckets on slime's fused route: one output processor returning the log-prob processor's
results and the top-k processor's, and the per-sample ids of slime's rollout data placed back on
the packed rows of a micro-batch."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd.zigzag import local_rows
from megatron_rl_patches.integrations.slime.rows import response_positions
from megatron_rl_patches.processors.heads import one_row_selection, output_layer_pre_hooks_ran, topk_output_processor


def with_topk(log_prob: Callable, k: int | None, options: dict, topk_context: dict, union: bool = False) -> Callable:
    """The log-prob processor's dict plus "topk_log_probs" [b, s, k] and "tail" [b, s] (and
    "topk_ids" when `k` selects them, "ids_mask" with `union`); both read the same hidden states
    and the same row mask."""
    topk = topk_output_processor(k=k, union=union, **options)

    def process(*, output_layer: Any, context: dict | None = None, **kwargs: Any) -> dict:
        with one_row_selection():  # one host sync and one tensor-parallel check for the three ops
            result = dict(log_prob(output_layer=output_layer, context=context, **kwargs))
            with output_layer_pre_hooks_ran(output_layer):  # the log-prob call ran them for this forward
                shared = {key: value for key, value in (context or {}).items() if not key.startswith("kept_")}
                result.update(topk(output_layer=output_layer, context={**shared, **topk_context}, **kwargs))
        return result

    return process


def packed_ids(per_sample: list[torch.Tensor], positions: list[torch.Tensor], length: int,
               dtype: torch.dtype = torch.long) -> torch.Tensor:
    """[T, k] ids on the packed rows from per-sample [R_i, k] (rows outside responses: id 0); with
    `dtype=torch.bool`, an ids mask the same way (rows outside responses: False)."""
    if len(per_sample) != len(positions):
        raise ValueError(f"top-k ids for {len(per_sample)} samples, the micro-batch has {len(positions)}")
    k = per_sample[0].shape[-1]
    device = positions[0].device
    ids = torch.zeros(length, k, dtype=dtype, device=device)
    for sample, rows in zip(per_sample, positions):
        if sample.shape != (rows.numel(), k):
            raise ValueError(f"top-k ids of shape {tuple(sample.shape)} for a response of {rows.numel()} tokens "
                             f"(expected [{rows.numel()}, {k}])")
        ids[rows] = sample.to(device=device, dtype=dtype)
    return ids


def topk_context(request: Any, batch: dict, length: int, device: Any, allgather_cp: bool) -> dict:
    """The top-k processor's context for a micro-batch: {"ids": [1, T, k]} (and "ids_mask" when the
    request names one) when the request reads the batch's ids, else {} (the processor selects its own)."""
    if request.ids_key is None:
        return {}

    per_sample = batch.get(request.ids_key)
    if per_sample is None:
        raise RuntimeError(f"slime_opd: the micro-batch has no {request.ids_key!r}; the actor's top-k pass did not "
                           "run before this step (apply the slime_opd patch with slime_fused)")
    positions = response_positions(batch, length, device, allgather_cp)
    masks = None if request.mask_key is None else batch[request.mask_key]
    if allgather_cp:
        per_sample, masks = local_rows(batch, length, per_sample, masks)
    context = {"ids": packed_ids(per_sample, positions, length)[None]}
    if masks is not None:
        context["ids_mask"] = packed_ids(masks, positions, length, dtype=torch.bool)[None]
    return context


def per_sample_rows(values: torch.Tensor, batch: dict, allgather_cp: bool = False) -> list[torch.Tensor]:
    """[1, T, ...] per-token values of a micro-batch as slime's per-sample response slices."""
    rows = values.reshape(-1, *values.shape[2:])
    return [rows[p] for p in response_positions(batch, rows.shape[0], rows.device, allgather_cp)]
