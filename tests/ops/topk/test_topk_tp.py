"""Top-k OPD with the vocab sharded over TP=2 (gloo) equals TP=1: ids, log-probs, loss, grads."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import topk_ids, topk_logprobs, topk_opd_loss
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

# Tests of the deprecated kl=/mix= (and of forms reachable only through them): opted out of the
# suite-wide "the package's deprecations are errors" filter (pyproject.toml).
pytestmark = pytest.mark.filterwarnings("ignore:kl=/mix= are deprecated:DeprecationWarning")

T, V_LOCAL, K, VOCAB = 12, 40, 6, 75  # padded vocab 80 over two ranks; rank 1 owns 35 real columns


def _inputs():
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(T, 2 * V_LOCAL, generator=gen) * 3
    logits[:, VOCAB:] = 50.0  # padding garbage: never selected, never counted
    # rows 0, 1: the top-k ids 6 above a flat rest, on rank 0 / rank 1: tails with their own shift
    # (kept |tail| < 8, so that float32 spacing there stays below the 1e-6 tolerance)
    logits[:2, :VOCAB] *= 0.03
    logits[0, 2 : 2 + K] += 6.0
    logits[1, V_LOCAL + 1 : V_LOCAL + 1 + K] += 6.0
    ties = torch.randint(0, 3, (T, 2 * V_LOCAL), generator=gen).float()  # ties across the shard boundary
    tau = torch.rand(T, generator=gen) + 0.5
    teachers = torch.log_softmax(torch.randn(3, T, VOCAB, generator=gen) * 2, dim=-1)
    g_lp, g_tail = torch.randn(T, K, generator=gen), torch.randn(T, generator=gen)
    return logits, ties, tau, teachers, g_lp, g_tail


def _compute(logits, ties, tau, teachers, g_lp, g_tail, group):
    """Everything compared between TP=1 (group None, full logits) and TP=2 (local shards)."""
    out = {
        "ids": topk_ids(logits, K, tp_group=group, vocab_size=VOCAB),
        "tie_ids": topk_ids(ties, K, tp_group=group, vocab_size=VOCAB),
        # rank 1 has only 3 real columns here: fewer than k local candidates
        "few_ids": topk_ids(logits, K, tp_group=group, vocab_size=V_LOCAL + 3),
        # bf16 logits on a coarse grid: ties at the k-th value within and across the shards
        "bf16_ids": topk_ids((logits * 2).round().bfloat16(), K, tp_group=group, vocab_size=VOCAB),
    }
    ids = out["ids"]
    x = logits.clone().requires_grad_(True)
    lp, tail = topk_logprobs(x, ids, tp_group=group, temperature=tau, vocab_size=VOCAB, chunk_size=5)
    ((lp * g_lp).sum() + (tail * g_tail).sum()).backward()
    out.update(lp=lp.detach(), tail=tail.detach(), lp_grad=x.grad)
    tlp = teachers.gather(-1, ids.expand(3, T, K))
    x = logits.clone().requires_grad_(True)
    loss = topk_opd_loss(
        x, ids, tlp, None, teacher_weights=[1.0, 2.0, 0.5], kl="mixed", mix=0.4,
        tp_group=group, temperature=tau, vocab_size=VOCAB, chunk_size=4,
    )
    loss.sum().backward()
    out.update(loss=loss.detach(), loss_grad=x.grad)
    return out


def _tp2_worker(rank, world_size, sizes):
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    logits, ties, tau, teachers, g_lp, g_tail = _inputs()
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    real_all_reduce, real_all_gather = dist.all_reduce, dist.all_gather

    def all_reduce(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    def all_gather(parts, tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return real_all_gather(parts, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = all_reduce, all_gather
    try:
        out = _compute(logits[:, cols].contiguous(), ties[:, cols].contiguous(), tau, teachers, g_lp, g_tail, group)
        out["comm_sizes"] = list(sizes)
        # collectives of one chunked top-k log-prob call: forward the mode's agreement (ops.agreement),
        # one MAX and one SUM; backward none
        x = logits[:, cols].clone().requires_grad_(True)
        del sizes[:]
        lp, tail = topk_logprobs(x, out["ids"], tp_group=group, temperature=tau, vocab_size=VOCAB, chunk_size=2)
        out["fwd_collectives"] = len(sizes)
        (lp.sum() + tail.sum()).backward()
        out["bwd_collectives"] = len(sizes) - out["fwd_collectives"]
    finally:
        dist.all_reduce, dist.all_gather = real_all_reduce, real_all_gather
    return out


@layouts.mark("tp2")
@pytest.mark.multirank
def test_tp2_equals_tp1():
    logits, ties, tau, teachers, g_lp, g_tail = _inputs()
    ref = _compute(logits, ties, tau, teachers, g_lp, g_tail, None)
    ranks = run_multirank(_tp2_worker, 2, [])

    # sanity of the TP=1 side: padded columns never selected, ties resolved towards lower ids
    assert bool((ref["ids"] < VOCAB).all())
    assert torch.equal(ref["ids"], logits[:, :VOCAB].topk(K).indices)
    stable = torch.sort(ties[:, :VOCAB], dim=-1, descending=True, stable=True).indices[:, :K]
    assert torch.equal(ref["tie_ids"], stable)
    assert bool((ref["few_ids"] < V_LOCAL + 3).all())
    coarse = (logits * 2).round().bfloat16()[:, :VOCAB]
    assert torch.equal(ref["bf16_ids"], torch.sort(coarse.float(), dim=-1, descending=True, stable=True).indices[:, :K])
    gap = (6.0 - 0.2) / tau[:2]  # ids at least this far (scaled) above the tail: far from the shared shift
    assert bool((gap > 2).all()) and bool((ref["tail"][:2] > -8).all())

    for rank, out in enumerate(ranks):
        cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
        for name in ("ids", "tie_ids", "few_ids", "bf16_ids"):
            assert torch.equal(out[name], ref[name]), f"rank {rank}: {name} differ"
        torch.testing.assert_close(out["lp"], ref["lp"], rtol=0, atol=1e-6)
        torch.testing.assert_close(out["tail"], ref["tail"], rtol=0, atol=1e-6)
        torch.testing.assert_close(out["loss"], ref["loss"], rtol=0, atol=1e-6)
        for name in ("lp_grad", "loss_grad"):
            torch.testing.assert_close(out[name], ref[name][:, cols], rtol=0, atol=1e-6)
            assert bool((out[name][:, max(0, VOCAB - rank * V_LOCAL):] == 0).all()), "padded columns got gradient"
        # communication is O(T·k) per collective, never O(T·V)
        assert out["comm_sizes"] and max(out["comm_sizes"]) <= T * (K + 2) < T * V_LOCAL
        assert out["fwd_collectives"] == 3 and out["bwd_collectives"] == 0
