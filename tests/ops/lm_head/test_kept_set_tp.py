"""`lm_head_kept_log_probs` under tensor parallelism (2 gloo ranks, one spawn): the kept ids
spread over both vocab shards, with and without sequence parallelism, equal TP = 1 (values,
grad_hidden, grad_weight); ranks holding different kept ids get a ValueError on every rank
(agreed by one collective) instead of mismatched all-reduces."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.ops.kept_set import lm_head_kept_log_probs
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = pytest.mark.multirank
T, H, V = 8, 6, 20


def _inputs():
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g)
    tokens = torch.randint(0, V, (T,), generator=g)
    # row r keeps ids from both halves of the vocabulary (both shards); row 3 none, row 5 without its target
    ids, rows = [], []
    for r in range(T):
        kept = [] if r == 3 else [(r * 3) % V, (r * 7 + 11) % V, (r + 12) % V]
        kept = [i for i in kept if not (r == 5 and i == int(tokens[r]))]
        ids += kept
        rows += [r] * len(kept)
    a = torch.randn(T, generator=g)
    return hidden, weight, tokens, torch.tensor(ids), torch.tensor(rows), a


def _compute(hidden, weight, tokens, ids, rows, a, group=None, sp=False):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = lm_head_kept_log_probs(h, w, tokens, ids, rows, tp_group=group, sequence_parallel=sp, temperature=0.8,
                                 chunk_size=3)
    (a * out).sum().backward()
    return [out.detach(), h.grad, w.grad]


def _ranks(rank, world_size):
    import torch.distributed as dist

    hidden, weight, tokens, ids, rows, a = _inputs()
    shard = weight[rank * V // 2: (rank + 1) * V // 2]
    results = [_compute(hidden, shard, tokens, ids, rows, a, dist.group.WORLD),
               _compute(hidden[rank * T // 2: (rank + 1) * T // 2], shard, tokens, ids, rows, a, dist.group.WORLD,
                        sp=True)]
    try:  # rank 1 drops one kept id: both ranks must refuse
        lm_head_kept_log_probs(hidden, shard, tokens, ids[: len(ids) - rank], rows[: len(rows) - rank],
                               tp_group=dist.group.WORLD)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return results, refused


@layouts.mark("tp2", "sp")
def test_kept_set_at_tp2_equals_tp1_and_disagreement_is_refused_on_every_rank():
    want = _compute(*_inputs())
    for rank, (results, refused) in enumerate(run_multirank(_ranks, 2, timeout=300)):
        for sp, got in enumerate(results):
            expected = [want[0], want[1] if not sp else want[1][rank * T // 2: (rank + 1) * T // 2],
                        want[2][rank * V // 2: (rank + 1) * V // 2]]
            for name, g, w in zip(("log_probs", "grad_hidden", "grad_weight"), got, expected):
                torch.testing.assert_close(g, w, rtol=0, atol=2e-6, msg=f"{name} sp={sp} rank={rank}")
        assert "differ across the tensor-parallel ranks" in refused, refused
