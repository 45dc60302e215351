"""Every op with `row_mask=` under tensor parallelism (gloo, TP = 2, one world for the module): a
mask that differs across the ranks is refused with a ValueError naming `row_mask` on every rank
(never a hang), also when the two masks' rows cancel in a linear checksum ({0, 4} and {1, 3});
the same mask on both ranks gives the TP = 1 values.

In the same world, the other per-rank arguments that shape the ops' collective work (issue 72 item
5): `temperature` 0.5 on one rank and 1.0 on the other, `vocab_size` given on one rank only, `k`
(or the ids' width) differing — each refused on every rank with a ValueError naming the argument
(before: the first two combined silently, the third crashed in gloo)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.ops.divergence import lm_head_divergence
from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy, lm_head_topk_ids, lm_head_topk_logprobs
from megatron_rl_patches.ops.logprobs import log_probs_and_entropy
from megatron_rl_patches.ops.topk import topk_ids, topk_logprobs, topk_opd_loss
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = pytest.mark.multirank
T, H, V, K = 5, 4, 8, 2
# per case: (rank 0's selected rows, rank 1's); "agree" must equal TP = 1
CASES = {
    "differs": ([0, 1], [0]),
    "collision": ([0, 4], [1, 3]),  # same count, same sum of indices (and of any linear checksum)
    "agree": ([0, 2, 4], [0, 2, 4]),
    "none": ([], []),  # a rank that reads no row (verl's fused route at CP = 2 x TP = 2: reshape(0, -1) failed)
}
# per argument: (rank 0's keywords, rank 1's) and the ops that take it
ARGUMENTS = {
    "temperature": (({"temperature": 0.5}, {"temperature": 1.0}),
                    ("log_probs_and_entropy", "topk_logprobs", "topk_opd_loss", "lm_head_log_probs_and_entropy",
                     "lm_head_topk_logprobs", "lm_head_divergence")),
    "vocab_size": (({}, {"vocab_size": V - 2}), None),  # None: every op
    "k": (({}, {"k": K - 1}), ("topk_ids", "topk_logprobs", "topk_opd_loss", "lm_head_topk_ids",
                               "lm_head_topk_logprobs")),
}
OPS = ("log_probs_and_entropy", "topk_ids", "topk_logprobs", "topk_opd_loss", "lm_head_log_probs_and_entropy",
       "lm_head_topk_ids", "lm_head_topk_logprobs", "lm_head_divergence")


def _inputs():
    g = torch.Generator().manual_seed(11)
    h, w = torch.randn(T, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)
    th, tw = torch.randn(T, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (T,), generator=g)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(T)])
    teacher = torch.log_softmax(torch.randn(T, K + 1, generator=g, dtype=torch.float64), dim=-1)[:, :K]
    return h, w, th, tw, tokens, ids, teacher


def _mask(rows):
    mask = torch.zeros(T, dtype=torch.bool)
    mask[rows] = True
    return mask


def _run(op, mask, h, w, th, tw, tokens, ids, teacher, group, k=K, **given):
    x = h @ w.t()
    ids, teacher = ids[:, :k], teacher[:, :k]
    calls = {
        "log_probs_and_entropy": lambda: log_probs_and_entropy(x, tokens, tp_group=group, with_entropy=True,
                                                               row_mask=mask, **given),
        "topk_ids": lambda: topk_ids(x, k, tp_group=group, row_mask=mask, **given),
        "topk_logprobs": lambda: topk_logprobs(x, ids, tp_group=group, row_mask=mask, **given),
        "topk_opd_loss": lambda: topk_opd_loss(x, ids, teacher, tp_group=group, row_mask=mask, **given),
        "lm_head_log_probs_and_entropy": lambda: lm_head_log_probs_and_entropy(h, w, tokens, tp_group=group,
                                                                               with_entropy=True, row_mask=mask,
                                                                               **given),
        "lm_head_topk_ids": lambda: lm_head_topk_ids(h, w, k, tp_group=group, row_mask=mask, **given),
        "lm_head_topk_logprobs": lambda: lm_head_topk_logprobs(h, w, ids, tp_group=group, row_mask=mask, **given),
        "lm_head_divergence": lambda: lm_head_divergence(h, w, th, tw, tp_group=group, row_mask=mask, **given),
    }
    out = calls[op]()
    return [t.detach() for t in (out if isinstance(out, tuple) else (out,))]


def _worker(rank, world_size):
    import torch.distributed as dist

    h, w, th, tw, tokens, ids, teacher = _inputs()
    shard = slice(rank * V // world_size, (rank + 1) * V // world_size)
    results = {}
    for case, masks in CASES.items():
        for op in OPS:
            try:
                results[case, op] = _run(op, _mask(masks[rank]), h, w[shard], th, tw[shard], tokens, ids, teacher,
                                         dist.group.WORLD)
            except ValueError as exc:
                results[case, op] = str(exc)
    mask = _mask(CASES["agree"][0])
    for argument, (given, ops) in ARGUMENTS.items():
        for op in ops or OPS:
            try:
                _run(op, mask, h, w[shard], th, tw[shard], tokens, ids, teacher, dist.group.WORLD, **given[rank])
                results[argument, op] = None
            except (ValueError, TypeError) as exc:
                results[argument, op] = f"{type(exc).__name__}: {exc}"
    return results


@pytest.fixture(scope="module")
def tp2():
    return run_multirank(_worker, 2, timeout=120)  # a rank that hangs fails the module, not the suite


@pytest.mark.parametrize("case", ["differs", "collision"])
def test_masks_that_differ_across_ranks_are_refused_on_every_rank(tp2, case):
    for rank, results in enumerate(tp2):
        for op in OPS:
            got = results[case, op]
            assert isinstance(got, str), f"{op} accepted rank masks {CASES[case]} (rank {rank})"
            assert "row_mask" in got and "differs across the tensor-parallel ranks" in got, (op, rank, got)


@pytest.mark.parametrize("case", ["agree", "none"])
def test_the_same_mask_on_every_rank_equals_tp1(tp2, case):
    inputs = _inputs()
    for op in OPS:
        want = _run(op, _mask(CASES[case][0]), *inputs, None)
        for rank, results in enumerate(tp2):
            got = results[case, op]
            assert not isinstance(got, str), (op, rank, got)
            for g, e in zip(got, want, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=f"{op} rank {rank}")


@pytest.mark.parametrize("argument", list(ARGUMENTS))
def test_an_argument_that_differs_across_ranks_is_refused_on_every_rank_naming_it(tp2, argument):
    given, ops = ARGUMENTS[argument]
    for op in ops or OPS:
        said = [results[argument, op] for results in tp2]
        for rank, got in enumerate(said):
            assert got is not None, f"{op} accepted {argument} {given} (rank {rank})"
            assert got.startswith("ValueError") and f"{argument} differs between the ranks" in got, \
                (op, rank, got)
        assert said[0] == said[1], (op, said)  # the same error on every rank
