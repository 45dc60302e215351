"""A rollout's top-p nuclei as the log-prob processor's kept-set context (`kept_ids`,
`kept_positions`, `kept_row_mask`: `heads.kept_log_probs` renormalizes each row's log-prob over
its kept ids and the target), never a dense [T, V] keep-mask. The nuclei come per sample in the
compressed-row form a rollout engine returns them in: flat kept ids with per-token offsets
(response token r keeps ids[offsets[r]:offsets[r + 1]]; tokens past the offsets keep the whole
vocabulary). Framework-free: the host maps each sample's response tokens to its local packed rows
(slime's top-p replay: `integrations.slime.top_p`)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def nucleus_context(samples: Iterable[tuple[torch.Tensor, torch.Tensor, Any, Any]], length: int, device: Any, *,
                    who: str, ids_name: str = "ids", offsets_name: str = "offsets") -> dict[str, torch.Tensor]:
    """The kept-set context keys over `length` local rows from per sample `(rows, tokens, ids,
    offsets)`: its local rows, the response token (of [0, R)) each row predicts, in the same order,
    and its nuclei (ids and offsets: tensors or host lists). Bad offsets are a ValueError naming
    `offsets_name` and `ids_name` (`who` first); rows and tokens that disagree in count, a
    RuntimeError (the host's mapping is wrong)."""
    ids_out, positions_out = [], []
    row_mask = torch.zeros(length, dtype=torch.bool, device=device)
    for rows, tokens, ids, offsets in samples:
        ids = torch.as_tensor(ids, dtype=torch.long).to(device)
        offsets = torch.as_tensor(offsets, dtype=torch.long)
        if offsets.numel() and int(offsets[0]) < 0:  # read where the host keeps them (host lists): no device sync
            raise ValueError(f"{who}: {offsets_name} must start at 0 or above (the first token's ids begin there), "
                             f"got {offsets.tolist()}")
        offsets = offsets.to(device)
        if tokens.numel() != rows.numel():
            raise RuntimeError(f"{who}: {rows.numel()} local response rows but {tokens.numel()} response tokens "
                               "of a sample; please report this")
        replayed = tokens < offsets.numel() - 1  # tokens past the offsets keep the full vocabulary
        rows, tokens = rows[replayed], tokens[replayed]
        counts = offsets[tokens + 1] - offsets[tokens]
        if bool((counts < 0).any()) or (tokens.numel() and int(offsets[tokens + 1].max()) > ids.numel()):
            raise ValueError(f"{who}: {offsets_name} must be non-decreasing and end within {ids_name} "
                             f"({ids.numel()} ids), got {offsets.tolist()}")
        row_mask[rows] = True
        first = torch.repeat_interleave(offsets[tokens] - (counts.cumsum(0) - counts), counts)
        ids_out.append(ids[first + torch.arange(first.numel(), device=device)])
        positions_out.append(torch.repeat_interleave(rows, counts))
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return {"kept_ids": torch.cat([empty, *ids_out]), "kept_positions": torch.cat([empty, *positions_out]),
            "kept_row_mask": row_mask[None]}
