"""A sharing plan's context-parallel cut at its edges, without a world: rows past the last
`cu_seqlens` boundary (padding a framework leaves outside its sequences) are one more sequence,
cut as the caller cut its ids; a rank's pieces put each row's own segment first whatever order the
rule's blocks came in; the refusal of a stream the ranks cannot cut into equal chunks, said whole."""
from __future__ import annotations

import pytest
import torch
from kit.shared_prefix import packed_ids

from megatron_rl_patches.ops.context_rows import local_rows
from megatron_rl_patches.shared_prefix.attention_rule import Block
from megatron_rl_patches.shared_prefix.context_parallel import physical_share, pieces_of_rows, share_of
from megatron_rl_patches.shared_prefix.plan import plan_shared_prefix


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_rows_past_the_last_boundary_are_one_more_sequence_of_the_cut(layout):
    tokens, cu = packed_ids([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 10, 11, 12, 13]], padding=4)  # past cu[-1] = 16
    plan = plan_shared_prefix(tokens, cu, pad_to=4)
    assert plan.logical_length == 20 and int(plan.sequence_bounds[-1]) == 16
    shares = [share_of(plan, 2, rank, layout).logical for rank in range(2)]
    want = [local_rows(layout, rank, 2, cu_seqlens=torch.tensor([0, 8, 16, 20])) for rank in range(2)]
    assert [s.tolist() for s in shares] == [w.tolist() for w in want]
    assert sorted(torch.cat(shares).tolist()) == list(range(20))  # every row, the padding's too, once


def test_a_ranks_pieces_put_each_rows_own_segment_first_whatever_the_order_given():
    window = torch.tensor([[True, False, False, False], [True, True, False, False]])  # rows 4-5 see keys 0-1 only
    blocks = (Block((0, 4), (0, 4), True), Block((4, 6), (0, 4), False, window), Block((4, 6), (4, 6), True))
    got = pieces_of_rows(blocks, torch.arange(6))
    assert [(b.rows, b.keys, b.own) for b in got] == [((0, 4), (0, 4), True), ((4, 6), (4, 6), True),
                                                       ((4, 6), (0, 4), False)]
    assert torch.equal(got[2].mask, window)


def test_a_stream_the_ranks_cannot_cut_into_equal_chunks_is_refused_whole():
    tokens, cu = packed_ids([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8]])
    plan = plan_shared_prefix(tokens, cu)  # 3 + 2 + 3 = 8 rows: 3 context-parallel ranks need 6 equal chunks
    with pytest.raises(ValueError) as refused:
        physical_share(plan, 3, 0)
    assert str(refused.value) == (
        "shared prefix: the plan's stream has 8 rows to compute, which 3 context-parallel ranks cannot cut into 6 "
        "equal chunks; build the plan with pad_to a multiple of 6 (times the tensor-parallel size under sequence "
        "parallelism)")
