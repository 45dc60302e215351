"""The fused LM head under tensor parallelism (gloo ranks): vocab-sharded weight, with and without
sequence parallelism, equals TP = 1 — log-probs, entropy, grad_hidden, grad_weight, top-k ids,
top-k log-probs and tails. One spawn per world size."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl_patches import lm_head_log_probs_and_entropy, lm_head_topk_ids, lm_head_topk_logprobs
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = pytest.mark.multirank
T, H, V, K = 24, 10, 96, 5  # V divisible by 4; T by 4 for sequence parallelism


def _inputs():
    g = torch.Generator().manual_seed(11)
    h = torch.randn(T, H, generator=g) * 2
    w = torch.randn(V, H, generator=g)
    tokens = torch.randint(0, V - 6, (T,), generator=g)
    a, b = torch.randn(T, generator=g), 0.3 * torch.randn(T, generator=g)
    tau = torch.rand(T, generator=g) + 0.5
    return h, w, tokens, a, b, tau


def _compute(h, w, tokens, a, b, tau, group=None, sp=False, ids=None):
    """Everything as numpy: (lp, ent, grad_h, grad_w, ids, topk_lp, tail, topk grad_h, topk grad_w)."""
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = lm_head_log_probs_and_entropy(hh, ww, tokens, tp_group=group, sequence_parallel=sp, temperature=tau,
                                            with_entropy=True, vocab_size=V - 3, chunk_size=5)
    ((a * lp).sum() + (b * ent).sum()).backward()
    out = [lp, ent, hh.grad, ww.grad]
    ids = lm_head_topk_ids(h, w, K, tp_group=group, sequence_parallel=sp, vocab_size=V - 3) if ids is None else ids
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    tlp, tail = lm_head_topk_logprobs(hh, ww, ids, tp_group=group, sequence_parallel=sp, temperature=0.8,
                                      vocab_size=V - 3)
    (tlp.sum() * 0.5 + tail.sum()).backward()
    return [t.detach().numpy() for t in out + [ids, tlp, tail, hh.grad, ww.grad]]


def _worker(rank, world_size, sp):
    import torch.distributed as dist

    h, w, tokens, a, b, tau = _inputs()
    rows = V // world_size
    w_local = w[rank * rows : (rank + 1) * rows]
    if sp:
        per = T // world_size
        h = h[rank * per : (rank + 1) * per]
    return _compute(h, w_local, tokens, a, b, tau, group=dist.group.WORLD, sp=sp)


def _tp_cases(rank, world_size):
    return [_worker(rank, world_size, False), _worker(rank, world_size, True)]


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=layouts.mark("tp2", "sp")), 4])
def test_tensor_and_sequence_parallel_equal_tp1(world_size):
    want = _compute(*_inputs())
    results = run_multirank(_tp_cases, world_size, timeout=300)
    names = ("log_probs", "entropy", "grad_hidden", "grad_weight", "ids", "topk_lp", "tail", "topk_grad_hidden",
             "topk_grad_weight")
    rows, per = V // world_size, T // world_size
    for sp in (False, True):
        for rank, outs in enumerate(results):
            got = outs[int(sp)]
            for name, g, w in zip(names, got, want):
                if name.endswith("grad_weight"):
                    w = w[rank * rows : (rank + 1) * rows]
                if name.endswith("grad_hidden") and sp:
                    w = w[rank * per : (rank + 1) * per]
                if name == "ids":
                    assert np.array_equal(g, w), (sp, rank)
                    continue
                scale = max(1.0, float(np.abs(w).max()))
                assert float(np.abs(g - w).max()) <= 2e-6 * scale, (name, sp, rank, float(np.abs(g - w).max()))
