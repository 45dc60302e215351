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


DIVERGENCE_CASES = ("jsd", "tv", "reverse_kl")


def _teacher(x: kit.Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(17)
    return (torch.randn(T, 16, generator=g, dtype=torch.float64),
            torch.randn(V, 16, generator=g, dtype=torch.float64) * 0.6)


def _rank_divergences(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    import torch.distributed as dist

    from megatron_rl_patches import lm_head_divergence
    from megatron_rl_patches.ops.kernels.triton import backend

    served = []  # the kernels' steps that ran in this rank (no test passes on the torch fallback)
    for step in ("divergence_sums", "divergence_grad"):
        real = getattr(backend.TritonTiles, step)
        setattr(backend.TritonTiles, step,
                lambda self, *a, _real=real, _step=step: served.append(_step) or _real(self, *a))
    x = _inputs()
    th, tw = _teacher(x)
    cols = slice(rank * (V // world_size), (rank + 1) * (V // world_size))
    out = []
    for divergence in DIVERGENCE_CASES:
        h = x.hidden.float().requires_grad_()
        w = x.weight[cols].float().requires_grad_()
        value = lm_head_divergence(h, w, th.float(), tw[cols].float(), divergence=divergence, beta=0.3,
                                   keep_mask=x.keep[:, cols], temperature=x.tau.float(), vocab_size=VOCAB,
                                   tp_group=dist.group.WORLD, backend="triton")
        (value * x.a.float()).sum().backward()
        out.append([t.detach().double() for t in (value, h.grad, w.grad)])
    assert served == ["divergence_sums", "divergence_grad"] * 2 + ["divergence_grad"], served
    return out


def test_divergence_kernels_over_two_vocabulary_shards_equal_the_float64_reference():
    """lm_head_divergence's pass 2 and backward kernels per shard (padding on the second), the
    row sums and dL/dh summed over the ranks: the float64 TP = 1 dense reference."""
    from megatron_rl_patches.testing.divergence_reference import dense_divergence

    x = _inputs()
    th, tw = _teacher(x)
    want = []
    for divergence in DIVERGENCE_CASES:
        h, w = x.hidden.clone().requires_grad_(), x.weight.clone().requires_grad_()
        value = dense_divergence((h @ w.T)[:, :VOCAB], [(th @ tw.T)[:, :VOCAB]], divergence=divergence, beta=0.3,
                                 temperature=x.tau.double(), keep_mask=x.keep[:, :VOCAB])
        (value * x.a.double()).sum().backward()
        want.append([value.detach(), h.grad, w.grad])
    per = V // 2
    for rank, cases in enumerate(run_multirank(_rank_divergences, 2, timeout=300)):
        for got, ref in zip(cases, want):
            ref = [ref[0], ref[1], ref[2][rank * per:(rank + 1) * per]]
            kit.assert_close(got, ref, ("value", "grad_hidden", "grad_weight"), 2e-5)
