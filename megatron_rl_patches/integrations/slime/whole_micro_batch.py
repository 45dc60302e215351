"""The whole micro-batch slime's `get_batch` cut over the context-parallel ranks, rebuilt from what
the batch keeps (slime 624b824a): every sample whole (`unconcat_tokens`) and the stream's global
boundaries (`packed_seq_params.cu_seqlens_q`). By default slime pads each sample with id 0 to a
multiple of 2 · cp and cuts it in zigzag, then pads the local stream (its sequence times cp in
`cu_seqlens`); with `--allgather-cp` it concatenates the samples, pads the stream with id 0 to a
multiple of cp times its pad size and takes each rank's contiguous slice. Either way the whole
stream is each sample followed by id 0 up to its sequence's end, then id 0 to the last boundary:
the stream a shared-prefix plan is built from (`PrefixPass.params` checks that its cut is the rank's
ids, and packs the micro-batch whole where it is not)."""
from __future__ import annotations

from typing import Any

import torch

PAD_ID = 0  # slime's get_batch pads with id 0


def whole_micro_batch(batch: dict) -> torch.Tensor | None:
    """[T_whole] the ids of the micro-batch as slime held it before the context-parallel cut, on the
    device of its tokens; None where the batch does not say (no samples or boundaries, a sample
    longer than its sequence, fewer sequences than samples)."""
    samples: Any = batch.get("unconcat_tokens")
    params = batch.get("packed_seq_params")
    tokens = batch.get("tokens")
    cu_seqlens = getattr(params, "cu_seqlens_q", None)
    if not samples or not isinstance(cu_seqlens, torch.Tensor) or not isinstance(tokens, torch.Tensor):
        return None
    bounds = [int(b) for b in cu_seqlens.cpu().tolist()]
    if len(bounds) - 1 < len(samples):
        return None
    pieces = []
    for sample, start, end in zip(samples, bounds, bounds[1:]):
        if not isinstance(sample, torch.Tensor) or sample.dim() != 1 or not 0 < sample.numel() <= end - start:
            return None
        pieces.append(torch.nn.functional.pad(sample.to(tokens.device, torch.int64), (0, end - start - sample.numel()),
                                              value=PAD_ID))
    pieces.append(torch.full((bounds[-1] - bounds[len(samples)],), PAD_ID, dtype=torch.int64, device=tokens.device))
    return torch.cat(pieces)
