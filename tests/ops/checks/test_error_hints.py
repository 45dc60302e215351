"""Errors that point at the real mistake (issue 38): a vocab shard passed without `tp_group`,
sequence parallelism without a group, top-k ids of the wrong length, and `topk_opd_loss`'s help."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import lm_head_log_probs_and_entropy, log_probs_and_entropy, topk_opd_loss


def test_a_vocab_shard_without_tp_group_is_told_to_pass_it():
    shard = torch.randn(4, 8)  # [T, V/2] of a V = 16 model
    tokens = torch.tensor([1, 12, 3, 15])  # global ids
    with pytest.raises(ValueError, match="pass tp_group") as info:
        log_probs_and_entropy(shard, tokens)
    assert "rows [1, 3]" in str(info.value)
    with pytest.raises(ValueError) as negative:  # a negative id is padding, not a shard
        log_probs_and_entropy(shard, torch.tensor([1, -100, 3, 2]))
    assert "tp_group" not in str(negative.value) and "mask padding targets" in str(negative.value)


def test_the_fused_head_gives_the_same_hint():
    with pytest.raises(ValueError, match="pass tp_group"):
        lm_head_log_probs_and_entropy(torch.randn(3, 4), torch.randn(8, 4), torch.tensor([0, 9, 2]))


def test_sequence_parallel_without_a_group_is_refused():
    hidden, weight, tokens = torch.randn(3, 4), torch.randn(8, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="sequence_parallel=True needs tp_group"):
        lm_head_log_probs_and_entropy(hidden, weight, tokens, sequence_parallel=True)
    logp, _ = lm_head_log_probs_and_entropy(hidden, weight, tokens, sequence_parallel=False)
    assert logp.shape == (3,)


def test_ids_of_the_wrong_length_blame_ids_not_the_teacher():
    logits = torch.randn(5, 16, requires_grad=True)
    with pytest.raises(ValueError, match=r"^ids must have shape \[\*rows, k\] with rows \(5,\)"):
        topk_opd_loss(logits, torch.randint(0, 16, (6, 3)), torch.randn(5, 3).log_softmax(-1))


def test_the_help_of_topk_opd_loss_gives_shapes_and_every_divergence():
    from megatron_rl_patches.ops._divergences import DIVERGENCES

    doc = topk_opd_loss.__doc__ or ""
    assert "Shapes:" in doc and "ids [T, k]" in doc and "[n, T, k]" in doc and "Returns [T]" in doc
    assert all(f'"{name}"' in doc for name in DIVERGENCES)
