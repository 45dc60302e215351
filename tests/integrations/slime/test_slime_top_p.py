"""`slime_fused`'s top-p context without slime's source (the lane runs slime's own slicing): each
sample's nuclei (slime's flat ids and offsets) land on the packed rows of their response tokens,
empty nuclei mark their row with no id, tokens past the offsets stay unmarked (full vocabulary),
bad offsets are a ValueError naming the key, and a batch without top-p keys gives no context."""
from __future__ import annotations

import types

import pytest
import torch

from megatron_rl_patches.integrations.slime import rows as slime_rows
from megatron_rl_patches.integrations.slime.top_p import kept_context


@pytest.fixture
def cp1_slicing(monkeypatch):
    """slime's slicing at context-parallel size 1: sample i's response rows are the logits rows
    [end - R - 1, end - 1); its response tokens in order."""

    def positions(batch, length, device, allgather_cp):
        out, offset = [], 0
        for total, response in zip(batch["total_lengths"], batch["response_lengths"]):
            end = offset + total
            out.append(torch.arange(end - response - 1, end - 1))
            offset = end
        return out

    loss = types.SimpleNamespace(slice_log_prob_with_cp=lambda values, total, response: values)
    monkeypatch.setattr(slime_rows, "response_positions", positions)
    monkeypatch.setattr(slime_rows, "slime_loss", lambda: loss)


def _batch(**top_p):
    return {"total_lengths": [5, 6], "response_lengths": [3, 4], **top_p}


def test_nuclei_land_on_their_response_rows(cp1_slicing):
    # sample 0: tokens keep {7, 8}, {} (empty), {3}; sample 1: only its first two tokens are covered
    ctx = kept_context(_batch(rollout_top_p_token_ids=[torch.tensor([7, 8, 3], dtype=torch.int32), [9, 1, 2]],
                              rollout_top_p_token_offsets=[torch.tensor([0, 2, 2, 3]), [0, 1, 3]]), 11, "cpu")
    assert ctx is not None
    assert ctx["kept_ids"].tolist() == [7, 8, 3, 9, 1, 2]
    assert ctx["kept_positions"].tolist() == [1, 1, 3, 6, 7, 7]
    want = torch.zeros(1, 11, dtype=torch.bool)
    want[0, [1, 2, 3, 6, 7]] = True  # row 2: an empty nucleus (log-prob 0); rows 8, 9: past the offsets
    assert torch.equal(ctx["kept_row_mask"], want)


def test_bad_offsets_are_refused_and_no_keys_give_no_context(cp1_slicing):
    with pytest.raises(ValueError, match="rollout_top_p_token_offsets must be non-decreasing"):
        kept_context(_batch(rollout_top_p_token_ids=[[1, 2], []], rollout_top_p_token_offsets=[[0, 2, 1, 2], [0]]),
                     11, "cpu")
    with pytest.raises(ValueError, match="end within rollout_top_p_token_ids"):
        kept_context(_batch(rollout_top_p_token_ids=[[1], []], rollout_top_p_token_offsets=[[0, 1, 3], [0]]), 11,
                     "cpu")
    assert kept_context(_batch(), 11, "cpu") is None
