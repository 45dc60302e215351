"""The Triton kernels under tensor parallelism (2 gloo ranks, vocabulary-sharded logits and
weight, the last shard padded): every rank's outputs and gradients equal the float64 TP = 1
reference — log-prob + entropy with keep mask and per-row temperature, top-k log-probs + tail,
both sources. CPU ranks run the kernels under Triton's interpreter (inherited TRITON_INTERPRET)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import triton_kit as kit  # noqa: E402

from megatron_rl_patches.testing.multirank import run_multirank  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.multirank]
kit.require_kernels()
if kit.DEVICE.type == "cuda":
    pytest.skip("gloo ranks hold CPU tensors: run where the kernels run on CPU (the interpreter)",
                allow_module_level=True)

T, V, VOCAB = 20, 64, 61  # two shards of 32 rows; the second holds 3 padding rows


def _inputs() -> kit.Inputs:
    return kit.make_inputs(torch.float32, T=T, H=24, V=V, n_valid=VOCAB, k=4, seed=7)


def _rank_outputs(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    import torch.distributed as dist

    x = _inputs()
    per = V // world_size
    cols = slice(rank * per, (rank + 1) * per)
    group = dist.group.WORLD
    h = x.hidden.float().requires_grad_()
    w = x.weight[cols].float().requires_grad_()
    logits = (x.hidden.float() @ x.weight[cols].float().t()).requires_grad_()
    keep = x.keep[:, cols]
    out = []
    for fused in (False, True):
        args = (h, w) if fused else (logits,)
        common = dict(tp_group=group, vocab_size=VOCAB, backend="triton")
        op = kit.lm_head_log_probs_and_entropy if fused else kit.log_probs_and_entropy
        lp, ent = op(*args, x.tokens, with_entropy=True, keep_mask=keep, temperature=x.tau, **common)
        ((lp * x.a).sum() + (ent * x.b).sum()).backward()
        out.append([lp, ent, *(t.grad for t in args)])
        for t in args:
            t.grad = None
        op = kit.lm_head_topk_logprobs if fused else kit.topk_logprobs
        tlp, tail = op(*args, x.ids, temperature=x.tau, **common)
        (tlp.sum() * 0.3 + tail.sum()).backward()
        out.append([tlp, tail, *(t.grad for t in args)])
        for t in args:
            t.grad = None
    return [[t.detach().double() for t in case] for case in out]


def test_two_vocabulary_shards_equal_the_float64_reference():
    x = _inputs()
    want = []
    for fused in (False, True):
        want.append(kit.log_prob_run(x, backend=None, fused=fused, dtype=torch.float32, entropy=True, masked=True,
                                     row_tau=True, n_valid=VOCAB))
        want.append(kit.topk_run(x, backend=None, fused=fused, dtype=torch.float32, n_valid=VOCAB))
    per = V // 2
    for rank, cases in enumerate(run_multirank(_rank_outputs, 2, timeout=300)):
        cols = slice(rank * per, (rank + 1) * per)
        for index, (got, ref) in enumerate(zip(cases, want)):
            fused = index >= 2
            ref = list(ref)
            # this rank's shard of the weight's / the logits' gradient; dL/dh is summed over ranks
            ref[-1] = ref[-1][cols] if fused else ref[-1][:, cols]
            names = ("values", "second", "grad_0", "grad_1")
            kit.assert_close(got, ref, names, 2e-5)
