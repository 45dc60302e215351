"""`verl_rows.read_rows` (whole-batch host ops) against a per-sequence reference written from its
definition, on random micro-batches in verl's nested layout: empty sequences, responses of 0 and
longer than their sequence, loss masks on first and last tokens. No verl needed (a dict batch)."""
from __future__ import annotations

import torch

from megatron_rl_patches.integrations.verl import rows as verl_rows


def _nested(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


def _reference(lengths, responses, masks, with_responses: bool) -> torch.Tensor:
    """Per sequence of n rows: rows [n − r − 1, n − 1) (no_padding_2_padding's slice, clipped at
    0), position t where the mask holds t, and row t where it holds t + 1 inside the sequence."""
    out = []
    for n, r, mask in zip(lengths, responses, masks):
        row = torch.zeros(n, dtype=torch.bool)
        if with_responses:
            row[max(0, n - r - 1): max(0, n - 1)] = True
        if mask is not None:
            row |= mask
            row[:-1] |= mask[1:]
        out.append(row)
    return torch.cat(out)


def test_read_rows_equal_the_per_sequence_reference():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        b = int(torch.randint(1, 6, (1,), generator=g))
        lengths = torch.randint(0, 9, (b,), generator=g).tolist()
        lengths[-1] = max(lengths[-1], 1)  # nested tensors need one non-empty sequence
        with_responses, with_mask = trial % 3 != 1, trial % 3 != 0
        responses = [int(torch.randint(0, n + 3, (1,), generator=g)) for n in lengths]
        masks = [torch.rand(n, generator=g) < 0.3 for n in lengths]
        batch = {"input_ids": _nested([torch.zeros(n, dtype=torch.long) for n in lengths])}
        if with_responses:
            batch["prompts"] = _nested([torch.zeros(max(n - r, 0), dtype=torch.long)
                                        for n, r in zip(lengths, responses)])
            batch["responses"] = _nested([torch.zeros(r, dtype=torch.long) for r in responses])
        if with_mask:
            batch["loss_mask"] = _nested([m.long() for m in masks])
        want = _reference(lengths, responses, masks if with_mask else [None] * b, with_responses)
        got = verl_rows.read_rows(batch)
        assert got is not None and torch.equal(got, want), (lengths, responses, masks)
