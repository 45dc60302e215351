"""slime_opd's `--allgather-cp` row moves on 2 gloo context-parallel ranks with Megatron's parallel
state (the slime lane runs them inside slime's real `train_actor`): a pass's rows of this rank's
contiguous slice of the packed stream go to the rank's zigzag response rows (`zigzag_from_local`)
and back (`local_from_zigzag`), for float buckets (with their gradient), int64 ids and bool masks,
against the kit's zigzag layout over each sequence padded to 2·cp chunks (restricted to the
response's logits rows: slime's `cp_utils` offsets) and against the ops' own route
(`ops.packing.allgather_cp_to_zigzag`, called with the CP group), forward and backward."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

TOTALS, RESPONSES, K = (7, 9), (3, 5), 2  # a stream of 16 rows: 8 per rank


def _zigzag_rows(total: int, response: int):
    """Response rows (of [0, R)) this CP rank holds in zigzag, in its order."""
    import torch
    from megatron.core import parallel_state

    from megatron_rl_patches.testing.cp_layout import sequence_rows

    cp = parallel_state.get_context_parallel_world_size()
    padded = -(-total // (2 * cp)) * 2 * cp
    rows = sequence_rows("zigzag", parallel_state.get_context_parallel_rank(), cp, padded)
    first = total - response - 1  # the logits row of the first response token
    return torch.tensor([int(r) - first for r in rows if first <= r < total - 1], dtype=torch.long)


def _moved(rank: int, world_size: int) -> dict:
    import torch
    from megatron.core import parallel_state

    from megatron_rl_patches.integrations.megatron.opd import zigzag as allgather_cp
    from megatron_rl_patches.ops.packing import PackedLayout, allgather_cp_to_zigzag
    from megatron_rl_patches.testing.megatron_cpu import megatron_world

    with megatron_world("cpu", context_parallel=2):
        gen = torch.Generator().manual_seed(0)
        full = [torch.randn(r, K, generator=gen, dtype=torch.float64) for r in RESPONSES]
        ids = [torch.randint(0, 50, (r, K), generator=gen) for r in RESPONSES]
        masks = [torch.rand(r, K, generator=gen) > 0.5 for r in RESPONSES]
        local_len = sum(TOTALS) // 2
        spans, seq_start = [], 0
        for total, response in zip(TOTALS, RESPONSES):  # the contiguous slice's rows of each response
            first = seq_start + total - response - 1
            lo, hi = max(first, rank * local_len), min(first + response, (rank + 1) * local_len)
            spans.append((lo - first, hi - first) if hi > lo else (0, 0))
            seq_start += total
        layout = PackedLayout(TOTALS, RESPONSES, cp_size=2, cp_rank=rank, allgather_cp=True)
        group = parallel_state.get_context_parallel_group()
        out: dict = {"expected": {}, "got": {}, "ops": {}}
        for name, values in (("buckets", full), ("ids", ids), ("masks", masks)):
            pieces = [v[a:b].clone() for v, (a, b) in zip(values, spans)]
            twins = [p.clone() for p in pieces]  # the same pieces for the ops' route
            if name == "buckets":
                pieces, twins = [p.requires_grad_() for p in pieces], [p.requires_grad_() for p in twins]
            zigzag = allgather_cp.zigzag_from_local(pieces, local_len, list(TOTALS), list(RESPONSES))
            ops_zigzag = allgather_cp_to_zigzag(twins, layout, local_len, group)
            out["ops"][name] = [z.detach() for z in ops_zigzag]
            back = allgather_cp.local_from_zigzag([z.detach() for z in zigzag], local_len, list(TOTALS),
                                                  list(RESPONSES))
            expected = [v[_zigzag_rows(t, r)] for v, t, r in zip(values, TOTALS, RESPONSES)]
            out["expected"][name] = (expected, [p.detach() for p in pieces])
            out["got"][name] = ([z.detach() for z in zigzag], back)
            if name == "buckets":
                # each rank's loss: the sum of its zigzag rows; the all-reduce's backward sums the CP ranks'
                # gradients, and the zigzag rows partition each response: every local row gets exactly 1
                sum(z.sum() for z in zigzag).backward(retain_graph=True)
                out["grads"] = [p.grad for p in pieces]
                # a weighted loss on both routes: each local row's gradient is its weight at its zigzag row
                weights = [torch.randn(z.shape, generator=gen, dtype=torch.float64) for z in zigzag]
                for piece in pieces:
                    piece.grad = None
                sum((z * w).sum() for z, w in zip(zigzag, weights)).backward()
                sum((z * w).sum() for z, w in zip(ops_zigzag, weights)).backward()
                out["weighted_grads"] = ([p.grad for p in pieces], [t.grad for t in twins])
        return out


@pytest.fixture(scope="module")
def ranks() -> list:
    from megatron_rl_patches.testing.multirank import run_multirank

    return run_multirank(_moved, 2, timeout=60)


@pytest.mark.parametrize("name", ["buckets", "ids", "masks"])
def test_contiguous_rows_go_to_the_zigzag_rows_and_back(ranks, name):
    import torch

    for rank in ranks:
        (expected, pieces), (zigzag, back) = rank["expected"][name], rank["got"][name]
        for want, got in zip(expected, zigzag, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
        for want, got in zip(pieces, back, strict=True):
            assert torch.equal(got, want)
    held = [sum(p.shape[0] for p in rank["expected"][name][1]) for rank in ranks]
    assert all(held) and sum(held) == sum(RESPONSES)  # both ranks hold rows; together all of them


@pytest.mark.parametrize("name", ["buckets", "ids", "masks"])
def test_slimes_route_is_the_ops_route(ranks, name):
    import torch

    for rank in ranks:
        for want, got in zip(rank["ops"][name], rank["got"][name][0], strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
        slime_grads, ops_grads = rank["weighted_grads"]
        for want, got in zip(ops_grads, slime_grads, strict=True):
            assert torch.equal(got, want)
        assert any(bool(g.abs().sum() > 0) for g in slime_grads)


def test_the_zigzag_buckets_carry_their_gradient_to_every_ranks_rows(ranks):
    import torch

    for rank in ranks:
        for grad, piece in zip(rank["grads"], rank["expected"]["buckets"][1]):
            assert grad is not None and torch.equal(grad, torch.ones_like(piece))
