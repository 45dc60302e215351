"""A shared-prefix plan cut over context-parallel ranks, without a world: the rule's blocks read at
one rank's query rows cover exactly what the rule lets those rows see (each row's own segment
first), and one rank's attention of its rows against the whole stream equals those rows of the
whole attention, forward and backward (float64); the cuts a micro-batch cannot take are refused
by name with what to do."""
from __future__ import annotations

import pytest
import torch
from kit.shared_prefix import grpo_batch, tree_batch

from megatron_rl_patches.shared_prefix.attention import rule_pieces, share_masked_attention, shared_prefix_attention
from megatron_rl_patches.shared_prefix.attention_rule import sees
from megatron_rl_patches.shared_prefix.context_parallel import physical_share, pieces_of_rows, share_of

PLANS = {
    "groups": lambda: grpo_batch(((33, (3, 7)), (21, (3, 7, 11))), (5,), padding=6, seed=1).plan(pad_to=12),
    "tree": lambda: tree_batch(system=28, turns=((4, 8, 2), (4, 4, 3)), alone=(12,), per_turn=True, padding=4,
                               seed=7).plan(pad_to=12),
}


def _covered(blocks, rows: torch.Tensor, length: int) -> torch.Tensor:
    """How often each (query row, key) pair is computed by `blocks`; a row's first block its own."""
    count = torch.zeros(rows.numel(), length, dtype=torch.int64)
    first_seen = torch.zeros(rows.numel(), dtype=torch.bool)
    for block in blocks:
        (a, b), (s, e) = block.rows, block.keys
        if block.own:
            first_seen[a:b] = True
        else:
            assert bool(first_seen[a:b].all()), "a row's own segment comes first"
        seen = torch.ones(b - a, e - s, dtype=torch.int64)
        if block.causal:
            seen = seen.tril()
        if block.mask is not None:
            seen = block.mask.to(torch.int64)
        count[a:b, s:e] += seen
    return count


@pytest.mark.parametrize(("name", "size", "window"), [("groups", 3, None), ("tree", 2, None), ("tree", 2, 5)])
def test_a_ranks_blocks_cover_what_the_rule_lets_its_rows_see_once(name, size, window):
    plan = PLANS[name]()
    length = plan.physical_length
    for rank in range(size):
        rows = physical_share(plan, size, rank)
        count = _covered(pieces_of_rows(rule_pieces(plan, window), rows), rows, length)
        rule = sees(rows[:, None], torch.arange(length)[None, :], plan.reach, plan.positions, window)
        assert torch.equal(count, rule.to(torch.int64))
    assert torch.equal(torch.sort(torch.cat([physical_share(plan, size, r) for r in range(size)])).values,
                       torch.arange(length))


@pytest.mark.parametrize(("name", "sink"), [("groups", False), ("tree", True)])
def test_a_ranks_attention_equals_its_rows_of_the_whole(name, sink):
    plan = PLANS[name]()
    gen = torch.Generator().manual_seed(3)
    rows = plan.physical_length
    query = torch.randn(rows, 1, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    key, value = (torch.randn(rows, 1, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    offset = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True) if sink else None
    grad_out = torch.randn(rows, 1, 32, generator=gen, dtype=torch.float64)
    whole = shared_prefix_attention(query, key, value, plan, scale=0.3, route="mask", sink=offset)
    want = torch.autograd.grad(whole, [query, key, value] + ([offset] if sink else []), grad_out)
    got_out = torch.empty_like(whole)
    got = [torch.zeros_like(t) for t in want]
    for rank in range(2):
        held = physical_share(plan, 2, rank)
        for attend in (shared_prefix_attention, share_masked_attention):
            if attend is shared_prefix_attention:
                out = attend(query[held], key, value, plan, scale=0.3, route="mask", sink=offset, share=(2, rank))
            else:  # the dense route another device takes: its own rows under the rule's mask
                out = attend(query[held], key, value, plan, (2, rank), 0.3, 0.0, None, offset).flatten(2)
            grads = torch.autograd.grad(out, [query, key, value] + ([offset] if sink else []), grad_out[held])
            if attend is shared_prefix_attention:
                got_out[held] = out.detach()
                got = [g + h for g, h in zip(got, grads)]
            else:
                torch.testing.assert_close(out, whole[held], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_out, whole.detach(), rtol=1e-10, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_cuts_a_micro_batch_cannot_take_are_refused_with_what_to_do():
    batch = grpo_batch(((30, (3, 5)),), (), padding=2, seed=0)  # samples of 33 and 35 rows
    unpadded = batch.plan()
    assert unpadded.physical_length == 30 + 3 + 5 + 2  # the prompt once, each rest, each padding row
    with pytest.raises(ValueError, match=r"pad_to a multiple of 6"):
        physical_share(unpadded, 3, 0)
    with pytest.raises(ValueError, match=r"cannot be cut over 2 context-parallel ranks in the zigzag layout"):
        share_of(batch.plan(pad_to=4), 2, 0, "zigzag")
    assert share_of(batch.plan(pad_to=4), 2, 1, "contiguous").logical.tolist() == list(range(35, 70))
    with pytest.raises(ValueError, match=r"cp_layout must be one of zigzag, contiguous"):
        share_of(batch.plan(pad_to=4), 2, 0, "ring")
