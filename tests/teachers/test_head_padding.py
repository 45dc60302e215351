"""`head_padded_as`: a teacher head re-cut to the student's padded vocabulary (full-vocabulary OPD
compares output layers row by row): the real rows kept, zero rows past them, the same head when the
padding already agrees, and a padding that cannot hold the real rows refused. (Over a TP=2 group:
the slime lane's served-head K=vocab world at TP=2 with SP.)"""
from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from megatron_rl_patches.teachers.head.padding import head_padded_as
from megatron_rl_patches.teachers.head.teacher_head import TeacherHead


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


BELOW = ("head_padded_as(padded_vocab_size=4): a teacher head of 5 real rows (/dirs/teacher) cannot be padded to 4 "
         "rows over 1 tensor-parallel ranks: the student's padded vocabulary must hold the teacher's real one and "
         "split evenly over its tensor-parallel group")


def test_a_padding_below_the_real_vocabulary_is_refused_naming_the_head():
    with pytest.raises(ValueError) as caught:
        head_padded_as(_head(5, 8), 4)
    assert str(caught.value) == BELOW


@pytest.mark.parametrize(("asked", "shown"), [(128.0, "float 128.0"), ("128", "str '128'"), (None, "NoneType None"),
                                              (True, "bool True"), (torch.tensor(128), "Tensor tensor(128)")])
def test_a_padded_size_that_is_no_int_is_refused_naming_the_argument(asked, shown):
    with pytest.raises(TypeError, match=r"head_padded_as\(padded_vocab_size=\.\.\.\) must be an int .*got "
                                        + re.escape(shown) + "$"):
        head_padded_as(_head(5, 8), asked)


@pytest.mark.parametrize("asked", [0, -8, 4])
def test_a_padded_size_below_the_real_vocabulary_names_the_argument(asked):
    with pytest.raises(ValueError, match=rf"head_padded_as\(padded_vocab_size={asked}\): a teacher head of 5 real"):
        head_padded_as(_head(5, 8), asked)


def _two_ranks(rank: int, world: int, cases: list[list]) -> list[dict]:
    """Each case's size asked by rank 0 and rank 1 (and rank 1's head padded to the third, else 8), in one world."""
    import torch.distributed as dist

    group = dist.group.WORLD
    out: list[dict[str, Any]] = []
    for case in cases:
        padded = case[2] if rank and len(case) > 2 else 8
        rows = padded // 2
        shard = TeacherHead(_head(5, padded).weight[rank * rows:(rank + 1) * rows].clone(), 5, padded, rank * rows,
                            tp_group=group, source="/dirs/teacher")
        try:
            cut = head_padded_as(shard, case[rank])
        except (TypeError, ValueError) as error:
            out.append({"error": f"{type(error).__name__}: {error}"})
            continue
        out.append({"weight": cut.weight, "first": cut.first_id})
    return out


GROUP = "the teacher head's tensor-parallel group [0, 1]"


def test_over_two_ranks_each_shard_is_its_part_and_a_rank_asking_another_size_fails_on_both():
    """The shards gathered once, each rank keeping its rows of the single-rank cut; the sizes agreed
    before the gather: a rank asking 16 beside one asking 8 (which alone returns at once), one asking
    "16" (no int), or a rank whose head is already padded to 16 beside one padded to 8 (which alone
    would gather), is the same error on both ranks, not a wait in the gather."""
    from megatron_rl_patches.testing.multirank import run_multirank

    ranks = run_multirank(_two_ranks, 2, [[16, 16], [16, 8], [16, "16"], [16, 16, 16]])
    whole = head_padded_as(_head(5, 8), 16).weight
    for rank, (out, *_) in enumerate(ranks):
        assert out["first"] == rank * 8 and torch.equal(out["weight"], whole[rank * 8:(rank + 1) * 8])
    for case, words in ((1, f"ValueError: head_padded_as: padded_vocab_size differs between the ranks of {GROUP} "
                            "(rank 0: 16, rank 1: 8): pass the same padded_vocab_size on every rank"),
                        (2, "TypeError: head_padded_as(padded_vocab_size=...) must be an int (the student's padded "
                            "vocabulary: its output layer's rows over the tensor-parallel group), got str '16' "
                            f"[head_padded_as: refused on rank(s) [1] of {GROUP}, so on every rank]"),
                        (3, f"ValueError: head_padded_as: head_padded_vocab_size differs between the ranks of {GROUP} "
                            "(rank 0: 8, rank 1: 16): pass the same head_padded_vocab_size on every rank")):
        assert [outs[case].get("error") for outs in ranks] == [words] * 2
