"""Union ids with ids_mask under TP=2 (gloo): the logits and fused routes and the loss equal TP=1
and a float64 dense computation; padded slots hold ids of either shard and stay unmarked."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import lm_head_topk_logprobs, topk_ids, topk_logprobs, topk_opd_loss, union_ids
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

T, H, V_LOCAL, K, VOCAB = 8, 10, 30, 4, 57  # padded vocab 60 over two ranks


def _inputs():
    gen = torch.Generator().manual_seed(31)
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(2 * V_LOCAL, H, generator=gen, dtype=torch.float64) * 0.7
    teachers = torch.randn(3, T, VOCAB, generator=gen, dtype=torch.float64) * 2
    ids, mask = union_ids(topk_ids((hidden @ weight.T)[:, :VOCAB], K), topk_ids(teachers[0], K))
    # padding holds real ids of both shards (and repeats of real ids): none may be marked
    garbage = torch.randint(0, VOCAB, ids.shape, generator=gen)
    ids = torch.where(mask, ids, garbage)
    g_lp, g_tail = (torch.randn(T, 2 * K, generator=gen, dtype=torch.float64),
                    torch.randn(T, generator=gen, dtype=torch.float64))
    return hidden, weight, teachers, ids, mask, g_lp, g_tail


def _compute(hidden, weight, teachers, ids, mask, g_lp, g_tail, group):
    out = {}
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, tail = lm_head_topk_logprobs(h, w, ids, ids_mask=mask, tp_group=group, vocab_size=VOCAB, chunk_size=3)
    ((lp.masked_fill(~mask, 0) * g_lp).sum() + (tail * g_tail).sum()).backward()
    out.update(fused_lp=lp.detach(), fused_tail=tail.detach(), fused_dh=h.grad, fused_dw=w.grad)
    x = (weight @ hidden.T).T.contiguous().requires_grad_(True)
    lp, tail = topk_logprobs(x, ids, ids_mask=mask, tp_group=group, vocab_size=VOCAB, chunk_size=3)
    ((lp.masked_fill(~mask, 0) * g_lp).sum() + (tail * g_tail).sum()).backward()
    out.update(lp=lp.detach(), tail=tail.detach(), dx=x.grad)
    with torch.no_grad():
        scored = [topk_logprobs(t, ids, ids_mask=mask) for t in teachers]  # teachers unsharded: data
    x = (weight @ hidden.T).T.contiguous().requires_grad_(True)
    loss = topk_opd_loss(x, ids, torch.stack([s[0] for s in scored]), torch.stack([s[1] for s in scored]),
                         ids_mask=mask, divergence="jsd", beta=0.3, teacher_weights=[0.5, 0.3, 0.2],
                         tp_group=group, vocab_size=VOCAB, chunk_size=3)
    loss.sum().backward()
    out.update(loss=loss.detach(), loss_dx=x.grad)
    return out


def _worker(rank, world_size):
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    hidden, weight, teachers, ids, mask, g_lp, g_tail = _inputs()
    rows = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    return _compute(hidden, weight[rows].contiguous(), teachers, ids, mask, g_lp, g_tail, group)


def _dense(hidden, weight, ids, mask, g_lp, g_tail):
    """float64 buckets and logits' gradient, densely in probability space."""
    z = (hidden @ weight.T)[:, :VOCAB].clone().requires_grad_(True)
    p = torch.softmax(z, -1)
    at = p.gather(-1, ids).masked_fill(~mask, 0.0)
    lp, tail = at.log(), (1 - at.sum(-1)).log()
    ((lp.masked_fill(~mask, 0) * g_lp).sum() + (tail * g_tail).sum()).backward()
    return lp.detach(), tail.detach(), z.grad


@layouts.mark("tp2")
@pytest.mark.multirank
def test_masked_union_ids_tp2_equal_tp1_and_dense():
    hidden, weight, teachers, ids, mask, g_lp, g_tail = _inputs()
    assert bool((~mask).any())
    ref = _compute(hidden, weight, teachers, ids, mask, g_lp, g_tail, None)
    lp, tail, dz = _dense(hidden, weight, ids, mask, g_lp, g_tail)
    for got_lp, got_tail in ((ref["lp"], ref["tail"]), (ref["fused_lp"], ref["fused_tail"])):
        assert torch.equal(torch.isneginf(got_lp), ~mask)
        torch.testing.assert_close(got_lp[mask], lp[mask], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got_tail, tail, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ref["dx"][:, :VOCAB], dz, rtol=1e-9, atol=1e-9)
    for rank, out in enumerate(run_multirank(_worker, 2)):
        rows = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
        for name in ("lp", "tail", "fused_lp", "fused_tail", "loss", "fused_dh"):
            torch.testing.assert_close(out[name], ref[name], rtol=1e-9, atol=1e-12, msg=f"rank {rank}: {name}")
        torch.testing.assert_close(out["fused_dw"], ref["fused_dw"][rows], rtol=1e-9, atol=1e-12)
        for name in ("dx", "loss_dx"):
            torch.testing.assert_close(out[name], ref[name][:, rows], rtol=1e-9, atol=1e-12, msg=f"rank {rank}: {name}")
