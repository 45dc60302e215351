"""`head_padded_as`: a teacher head re-cut to the student's padded vocabulary (full-vocabulary OPD
compares output layers row by row): the real rows kept, zero rows past them, the same head when the
padding already agrees, and a padding that cannot hold the real rows refused. (Over a TP=2 group:
the slime lane's served-head K=vocab world at TP=2 with SP.)"""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers.head import TeacherHead
from megatron_rl_patches.teachers.head_padding import head_padded_as


def _head(vocab: int, padded: int) -> TeacherHead:
    weight = torch.zeros(padded, 3)
    weight[:vocab] = torch.arange(vocab * 3, dtype=torch.float32).reshape(vocab, 3) + 1
    return TeacherHead(weight, vocab, padded, 0, source="/dirs/teacher")


@pytest.mark.parametrize("padded", [5, 8, 16])
def test_the_real_rows_stay_and_the_padding_is_zero(padded):
    head = _head(5, 8)
    cut = head_padded_as(head, padded)
    assert (cut.padded_vocab_size, cut.vocab_size, tuple(cut.weight.shape)) == (padded, 5, (padded, 3))
    assert torch.equal(cut.weight[:5], head.weight[:5]) and not cut.weight[5:].any()
    assert head_padded_as(head, 8) is head


def test_a_padding_below_the_real_vocabulary_is_refused_naming_the_head():
    with pytest.raises(ValueError, match=r"5 real rows \(/dirs/teacher\) cannot be padded to 4 rows"):
        head_padded_as(_head(5, 8), 4)


def _two_ranks(rank: int, world: int, asked: list[int]) -> dict:
    import torch.distributed as dist

    whole = _head(5, 8)
    group = dist.group.WORLD
    shard = TeacherHead(whole.weight[rank * 4:(rank + 1) * 4].clone(), 5, 8, rank * 4, tp_group=group,
                        source="/dirs/teacher")
    try:
        cut = head_padded_as(shard, asked[rank])
    except ValueError as error:
        return {"error": str(error)}
    return {"weight": cut.weight, "first": cut.first_id}


def test_over_two_ranks_each_shard_is_its_part_and_a_rank_asking_another_size_fails_on_both():
    """The shards gathered once, each rank keeping its rows of the single-rank cut; the sizes agreed
    before the gather: a rank asking 16 beside one asking 8 (which alone returns at once) is the same
    error on both ranks, not a wait in the gather."""
    from megatron_rl_patches.testing.multirank import run_multirank

    ranks = run_multirank(_two_ranks, 2, [16, 16])
    whole = head_padded_as(_head(5, 8), 16).weight
    for rank, out in enumerate(ranks):
        assert out["first"] == rank * 8 and torch.equal(out["weight"], whole[rank * 8:(rank + 1) * 8])
    mixed = run_multirank(_two_ranks, 2, [16, 8])
    assert all("padded_vocab_size" in out.get("error", "") for out in mixed), mixed
    assert mixed[0]["error"] == mixed[1]["error"]
