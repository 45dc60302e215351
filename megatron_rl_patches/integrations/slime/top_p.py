"""slime's top-p replay on the fused route: the rollout's nucleus of each response token, as slime
carries it (per sample `rollout_top_p_token_ids`, flat, with `rollout_top_p_token_offsets`:
response token r keeps ids[offsets[r]:offsets[r + 1]]), turned into the kept-set context of the
log-prob processor (`processors.nucleus`) — the kept ids and their packed rows, never slime's dense
[T, V] keep-mask.
Semantics are slime 624b824a's `_build_topp_keep_mask`: the log-prob is renormalized over the
kept ids and the target, entropy stays unmasked, response tokens past the recorded offsets keep
the full vocabulary."""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd.zigzag import local_spans
from megatron_rl_patches.integrations.slime import rows as slime_rows  # read at call time: tests replace them
from megatron_rl_patches.processors.nucleus import nucleus_context

IDS, OFFSETS = "rollout_top_p_token_ids", "rollout_top_p_token_offsets"


def replays_top_p(args: Any) -> bool:
    """Whether slime's configuration replays the rollout's top-p nucleus (`--rollout-top-p` < 1)."""
    return getattr(args, "rollout_top_p", 1.0) != 1.0


def local_response_tokens(batch: dict, length: int, device: Any, allgather_cp: bool) -> list[torch.Tensor]:
    """Per sample, the response token (of [0, R)) of each local row slime's slicing reads, in its
    order: the rank's zigzag halves (`slice_log_prob_with_cp`; everything at context parallelism 1),
    or with `--allgather-cp` the span of the rank's contiguous slice of the packed stream."""
    totals, responses = batch["total_lengths"], batch["response_lengths"]
    if allgather_cp:
        return [torch.arange(start, end, device=device) for start, end in local_spans(length, totals, responses)]
    return [slime_rows.slime_loss().slice_log_prob_with_cp(torch.arange(response, device=device), total, response)
            for total, response in zip(totals, responses, strict=True)]


def kept_context(batch: dict, length: int, device: Any,
                 allgather_cp: bool = False) -> dict[str, torch.Tensor] | None:
    """The processor context keys ("kept_ids", "kept_positions", "kept_row_mask" [1, T]) of the
    micro-batch's nuclei on its local packed rows (context parallelism 1, zigzag, or the contiguous
    slice of `--allgather-cp` when `allgather_cp`: slime's own slicing picks each sample's rows and
    their response tokens, and the kept set of a row follows the row); None when the batch carries
    none (slime fetched no top-p keys: the step's loss does not replay them)."""
    if batch.get(IDS) is None or batch.get(OFFSETS) is None:
        return None
    pieces = slime_rows.response_positions(batch, length, device, allgather_cp)
    samples = zip(pieces, local_response_tokens(batch, length, device, allgather_cp), batch[IDS], batch[OFFSETS],
                  strict=True)
    return nucleus_context(samples, length, device, who="slime_fused", ids_name=IDS, offsets_name=OFFSETS)
