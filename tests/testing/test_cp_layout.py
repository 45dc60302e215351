"""Which rows each context-parallel rank holds (zigzag, contiguous; bshd and packed thd), and the
refusals of a layout the rows cannot take."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.cp_layout import local_rows, split_batch, split_rows


@layouts.mark("cp2-zigzag")
def test_zigzag_rank_holds_chunks_r_and_mirror():
    assert local_rows("zigzag", 0, 2, length=8).tolist() == [0, 1, 6, 7]
    assert local_rows("zigzag", 1, 2, length=8).tolist() == [2, 3, 4, 5]
    assert local_rows("zigzag", 2, 4, length=8).tolist() == [2, 5]


@layouts.mark("cp2-zigzag", "cp2-allgather", "thd")
def test_packed_rows_zigzag_per_sequence_contiguous_over_the_stream():
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    assert local_rows("zigzag", 0, 2, cu_seqlens=cu).tolist() == [0, 3, 4, 5, 10, 11]
    assert local_rows("contiguous", 1, 2, cu_seqlens=cu).tolist() == [6, 7, 8, 9, 10, 11]
    rows = torch.cat([local_rows("zigzag", r, 2, cu_seqlens=cu) for r in range(2)])
    assert sorted(rows.tolist()) == list(range(12))  # every row on exactly one rank


def test_split_batch_cuts_every_per_token_tensor_and_drops_the_mask():
    batch = {"tokens": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8) + 100,
             "attention_mask": torch.ones(2, 1, 8, 8, dtype=torch.bool), "extra": "kept"}
    local = split_batch(batch, "contiguous", 1, 2)
    assert local["tokens"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert local["labels"].tolist() == [[104, 105, 106, 107], [112, 113, 114, 115]]
    assert local["attention_mask"] is None and local["extra"] == "kept"


@pytest.mark.parametrize("call, message", [
    (lambda: local_rows("ring", 0, 2, length=8), "layout must be one of"),
    (lambda: local_rows("zigzag", 0, 2, length=6), "not a multiple of 4"),
    (lambda: local_rows("zigzag", 2, 2, length=8), "rank must be"),
    (lambda: local_rows("zigzag", 0, 2), "exactly one of length"),
    (lambda: split_rows(torch.zeros(10), 0, "zigzag", 0, 2, torch.tensor([0, 8])), "cu_seqlens cover 8"),
    (lambda: split_batch({"tokens": torch.zeros(8)}, "zigzag", 0, 2), "batch\\['tokens'\\] must be"),
])
def test_refusals_name_the_setting(call, message):
    with pytest.raises(ValueError, match=message):
        call()
