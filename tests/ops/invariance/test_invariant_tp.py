"""The invariant mode under tensor parallelism (gloo; one world per size, spawned once for the
session and shared with the CP layout checks: invariance_worlds.py): every op's values at TP = 2, 4,
8 (the OPD loss, and topk_kl on split log-probs) — vocabulary split in shards of any width,
sequence parallelism, a padded vocabulary — are the TP = 1 bits, in fp32 and bf16. The negative
control, the same on every CPU: each op at TP = world runs the invariant backend on every rank in
the invariant mode and none of it in the default mode (counted), so an op that dropped `invariant=` at
TP > 1 would fail here (the default mode's bits usually move with the split, but whether they do
is a matter of one CPU's roundings)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import ops
from megatron_rl_patches.testing.invariance import counting_invariant_calls

pytestmark = pytest.mark.multirank
T, H, V, K, VOCAB = 24, 32, 5000, 3, 4990  # V / 8 = 625: shard edges at no power of two


def _inputs(dtype):
    g = torch.Generator().manual_seed(5)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype)
    x = (torch.randn(T, V, generator=g) * 4).to(dtype)
    tokens = torch.randint(0, VOCAB, (T,), generator=g)
    ids = torch.argsort(torch.rand(T, VOCAB, generator=g), dim=1)[:, :K]
    tau = torch.rand(T, generator=g).add(0.5)
    teacher = torch.log_softmax(torch.randn(T, K + 1, generator=g), dim=-1)[:, :K]  # a teacher's top-k log-probs
    return h, w, x, tokens, ids, tau, teacher


def _cases(rank, world, dtype, invariant):
    """Each case's outputs at TP = 1 (full tensors, no group) and at TP = world, and the calls into
    the invariant code at TP = world."""
    import torch.distributed as dist

    group = dist.group.WORLD
    h, w, x, tokens, ids, tau, teacher = _inputs(dtype)
    shard = slice(rank * V // world, (rank + 1) * V // world)
    rows = slice(rank * T // world, (rank + 1) * T // world)
    opts = dict(invariant=invariant)
    calls = {
        "log_probs_and_entropy": lambda x, g: ops.log_probs_and_entropy(
            x, tokens, tp_group=g, temperature=tau, with_entropy=True, vocab_size=VOCAB, **opts),
        "topk_logprobs": lambda x, g: ops.topk_logprobs(x, ids, tp_group=g, vocab_size=VOCAB, **opts),
        "topk_ids": lambda x, g: (ops.topk_ids(x, K, tp_group=g, vocab_size=VOCAB, **opts),),
        # forward KL: the default mode's reverse KL (TP = 2) and JSD (TP = 4) keep their bits on these inputs
        "topk_opd_loss": lambda x, g: (ops.topk_opd_loss(x, ids, teacher, tp_group=g, vocab_size=VOCAB,
                                                         divergence="forward_kl", **opts),),
        "topk_kl": lambda x, g: (ops.topk_kl(*ops.topk_logprobs(x, ids, tp_group=g, vocab_size=VOCAB, **opts), teacher,
                                             divergence="forward_kl", **opts),),
    }
    fused = {
        "lm_head_log_probs_and_entropy": lambda h, w, g, sp: ops.lm_head_log_probs_and_entropy(
            h, w, tokens, tp_group=g, sequence_parallel=sp, temperature=tau, with_entropy=True, vocab_size=VOCAB,
            **opts),
        "lm_head_topk_logprobs": lambda h, w, g, sp: ops.lm_head_topk_logprobs(
            h, w, ids, tp_group=g, sequence_parallel=sp, vocab_size=VOCAB, **opts),
        "lm_head_topk_ids": lambda h, w, g, sp: (ops.lm_head_topk_ids(h, w, K, tp_group=g, sequence_parallel=sp,
                                                                      vocab_size=VOCAB, **opts),),
    }
    def counted(call, *args):
        with counting_invariant_calls() as used:
            got = call(*args)
        return got, used.backend

    out = {}
    for name, call in calls.items():
        out[name] = (call(x, None), *counted(call, x[:, shard], group))
    for name, call in fused.items():
        one = call(h, w, None, False)
        out[name] = (one, *counted(call, h, w[shard], group, False))
        out[name + "/sequence_parallel"] = (one, *counted(call, h[rows], w[shard], group, True))
    return out


def tp_checks(rank, world):
    """Per (case, dtype, invariant): whether TP = world gave the TP = 1 bits, by how much not, and
    how many calls into the invariant backend it made."""
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for invariant in (True, False):
            for name, (one, split, used) in _cases(rank, world, dtype, invariant).items():
                same = all(torch.equal(a, b) for a, b in zip(one, split))
                diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(one, split))
                results[name, str(dtype).removeprefix("torch."), invariant] = (same, diff, used)
    return results


@pytest.fixture(scope="module", params=[2, 4, 8])
def world(request, invariance_world):
    return request.param, invariance_world.results(request.param, "tp")


def test_every_op_at_every_split_gives_the_tp1_bits_and_runs_its_invariant_code_only_in_that_mode(world):
    size, results = world
    for rank_results in results:
        wrong = {case: diff for case, (same, diff, _) in rank_results.items() if case[2] and not same}
        assert not wrong, f"TP = {size}: invariant mode differs from TP = 1: {wrong}"
        # the negative control: the invariant backend ran in that mode only (topk_ids takes `invariant`
        # for symmetry: its ids are exact either way, from the same code)
        path = {case: used for case, (_, _, used) in rank_results.items() if case[0] != "topk_ids"}
        wrong_path = {case: used for case, used in path.items() if (used > 0) is not case[2]}
        assert not wrong_path, f"TP = {size}: (case, dtype, invariant): calls into the invariant backend {wrong_path}"
        ids = {case: (same, used) for case, (same, _, used) in rank_results.items() if case[0] == "topk_ids"}
        assert all(same and used == 0 for same, used in ids.values()), ids
    assert len(results[0]) == 2 * 2 * 11  # dtypes x modes x cases
