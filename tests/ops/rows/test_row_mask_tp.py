"""row_mask= under tensor parallelism (gloo, TP = 2): vocab-sharded logits and output weight, with
and without sequence parallelism (the mask covers the gathered rows), equal TP = 1 on the selected
rows and are 0 elsewhere; a mask that differs across ranks is refused on every rank."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy
from megatron_rl_patches.ops.logprobs import log_probs_and_entropy
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = pytest.mark.multirank
T, H, V = 16, 8, 40


def _inputs():
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g)
    tokens = torch.randint(0, V, (T,), generator=g)
    mask = torch.rand(T, generator=g) < 0.5
    a, b = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return h, w, tokens, mask, a, b


def _compute(h, w, tokens, mask, a, b, group=None, sp=False, h_all=None):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = lm_head_log_probs_and_entropy(hh, ww, tokens, tp_group=group, sequence_parallel=sp, with_entropy=True,
                                            row_mask=mask)
    ((a * lp).sum() + (b * ent).sum()).backward()
    x = ((h if h_all is None else h_all) @ w.t()).requires_grad_()
    lp2, ent2 = log_probs_and_entropy(x, tokens, tp_group=group, with_entropy=True, row_mask=mask)
    ((a * lp2).sum() + (b * ent2).sum()).backward()
    return [t.detach().numpy() for t in (lp, ent, hh.grad, ww.grad, lp2, ent2, x.grad)]


def _worker(rank, world_size):
    import torch.distributed as dist

    h, w, tokens, mask, a, b = _inputs()
    rows = V // world_size
    w_local = w[rank * rows : (rank + 1) * rows]
    per = T // world_size
    out = [_compute(h, w_local, tokens, mask, a, b, dist.group.WORLD),
           _compute(h[rank * per : (rank + 1) * per], w_local, tokens, mask, a, b, dist.group.WORLD, sp=True,
                    h_all=h)]
    differs = mask.clone()
    differs[rank] = not differs[rank]  # each rank flips a different row
    try:
        log_probs_and_entropy(h @ w_local.t(), tokens, tp_group=dist.group.WORLD, row_mask=differs)
        out.append("accepted")
    except ValueError as exc:
        out.append(str(exc))
    return out


def test_row_mask_tp2_and_sequence_parallel_equal_tp1():
    h, w, tokens, mask, a, b = _inputs()
    want = _compute(h, w, tokens, mask, a, b)
    results = run_multirank(_worker, 2, timeout=300)
    names = ("lp", "ent", "grad_h", "grad_w", "logits_lp", "logits_ent", "logits_grad")
    rows, per = V // 2, T // 2
    m = mask.numpy()
    for rank, outs in enumerate(results):
        for sp in (False, True):
            for name, got, exp in zip(names, outs[int(sp)], want):
                if name in ("grad_w", "logits_grad"):
                    shard = slice(rank * rows, (rank + 1) * rows)
                    exp = exp[shard] if name == "grad_w" else exp[:, shard]
                if name == "grad_h" and sp:
                    exp, sel = exp[rank * per : (rank + 1) * per], m[rank * per : (rank + 1) * per]
                else:
                    sel = m
                assert float(np.abs(got - exp).max()) <= 2e-5 * max(1.0, float(np.abs(exp).max())), (name, sp, rank)
                if name not in ("grad_w", "logits_grad"):
                    assert np.all(got[~sel] == 0), (name, sp, rank)
        assert "differs across the tensor-parallel ranks" in outs[2], outs[2]
