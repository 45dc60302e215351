"""The Triton kernels under tensor parallelism (2 gloo ranks, vocabulary-sharded logits and
weight, the last shard padded): every rank's outputs and gradients equal the float64 TP = 1
reference — log-prob + entropy with keep mask and per-row temperature, top-k log-probs + tail,
both sources, the fused head on the `triton` and the `gemm` backends. CPU ranks run the kernels
under Triton's interpreter (inherited TRITON_INTERPRET)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import triton_kit as kit  # noqa: E402

from megatron_rl_patches.ops.kernels import resolve_backend  # noqa: E402
from megatron_rl_patches.testing.invariance import counting_invariant_calls  # noqa: E402
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
    # the fused head on both of its CUDA routes: the Triton GEMM, and the vendor GEMM + row pass
    for fused, backend in ((False, "triton"), (True, "triton"), (True, "gemm")):
        args = (h, w) if fused else (logits,)
        common = dict(tp_group=group, vocab_size=VOCAB, backend=backend)
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
    return ([[t.detach().double() for t in case] for case in out], _invariant_splits(rank, world_size),
            _mixed_backends(rank))


def _mixed_backends(rank: int) -> tuple[str, str]:
    """The invariant mode with the torch tiles on rank 0 and the Triton kernel on rank 1: the two
    run different collectives (a hang unless the kernels are agreed with the mode): the error."""
    import torch.distributed as dist

    x = _inputs()
    h, w = x.hidden.float(), x.weight[rank * V // 2: (rank + 1) * V // 2].float()
    try:
        kit.lm_head_log_probs_and_entropy(h, w, x.tokens, tp_group=dist.group.WORLD, vocab_size=VOCAB,
                                          invariant=True, backend="triton" if rank else "torch")
    except Exception as exc:  # noqa: BLE001 - the kind and the words are the result
        return type(exc).__name__, str(exc)
    return "", ""


def _logit_values(x: kit.Inputs, z: torch.Tensor, group, **opts) -> list[torch.Tensor]:
    """Log-prob, entropy, top-k log-probs and tail of logits `z` (forward only)."""
    return [*kit.log_probs_and_entropy(z, x.tokens, with_entropy=True, temperature=x.tau, tp_group=group, **opts),
            *kit.topk_logprobs(z, x.ids, temperature=x.tau, tp_group=group, **opts)]


def _fused_values(x: kit.Inputs, h: torch.Tensor, w: torch.Tensor, group, **opts) -> list[torch.Tensor]:
    """The same from hidden states `h` and a weight shard `w`."""
    return [*kit.lm_head_log_probs_and_entropy(h, w, x.tokens, with_entropy=True, temperature=x.tau, tp_group=group,
                                               **opts),
            *kit.lm_head_topk_logprobs(h, w, x.ids, temperature=x.tau, tp_group=group, **opts)]


def _invariant_splits(rank: int, world_size: int) -> dict[tuple[str, str, bool], tuple[bool, int]]:
    """Per (route, dtype, invariant): whether TP = world_size gave the TP = 1 bits from the Triton
    backend (forward values), and its calls into the invariant backend at TP = world_size; the fused
    head with and without sequence parallelism."""
    import torch.distributed as dist

    x = _inputs()
    group = dist.group.WORLD
    per = V // world_size
    cols, rows = slice(rank * per, (rank + 1) * per), slice(rank * T // world_size, (rank + 1) * T // world_size)
    results = {}
    # fp32: every route in both modes; bf16 (the interpreter is slow): the fused head, invariant
    for dtype, modes in ((torch.float32, (True, False)), (torch.bfloat16, (True,))):
        h, w = x.hidden.to(dtype), x.weight.to(dtype)
        logits = (h @ w.t()).float()
        for invariant in modes:
            opts = dict(vocab_size=VOCAB, backend="triton", invariant=invariant)
            fused_one = _fused_values(x, h, w, None, **opts)
            cases = {
                "fused": (fused_one, _counted(_fused_values, x, h, w[cols], group, **opts)),
                "fused/sequence_parallel": (fused_one, _counted(_fused_values, x, h[rows], w[cols], group,
                                                                sequence_parallel=True, **opts)),
            }
            if dtype == torch.float32:
                cases["logits"] = (_logit_values(x, logits, None, **opts),
                                   _counted(_logit_values, x, logits[:, cols], group, **opts))
            for route, (a, (b, used)) in cases.items():
                same = all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
                results[route, str(dtype), invariant] = (same, used)
    return results


def _counted(values, *args, **kwargs):
    """`values(*args, **kwargs)` and its calls into the invariant backend."""
    with counting_invariant_calls() as used:
        got = values(*args, **kwargs)
    return got, used.backend


def test_two_vocabulary_shards_equal_the_float64_reference_and_the_invariant_kernel_the_tp1_bits():
    """The float64 TP = 1 reference; and the invariant mode's kernel at TP = 2 (integer sums
    all-reduced) gives the TP = 1 bits on every route and dtype. The negative control, the same on
    every CPU: the invariant mode ran the invariant backend on every route, the default mode none of
    it (counted; the default mode's rescaled float sums usually move with the split, but whether
    they do is a matter of one CPU's roundings)."""
    x = _inputs()
    want = []
    for fused in (False, True):
        want.append(kit.log_prob_run(x, backend=None, fused=fused, dtype=torch.float32, entropy=True, masked=True,
                                     row_tau=True, n_valid=VOCAB))
        want.append(kit.topk_run(x, backend=None, fused=fused, dtype=torch.float32, n_valid=VOCAB))
    want += want[2:]  # the gemm backend's fused cases: the same references
    per = V // 2
    # rank 0's route: the torch invariant tiles (on CPU their compiled sums where they build)
    tiles = resolve_backend("torch", kit.DEVICE, torch.float32, invariant=True)
    tiles_route = f"{tiles.name} ({type(tiles).__name__})"
    for rank, (cases, splits, mixed) in enumerate(run_multirank(_rank_outputs, 2, timeout=300)):
        # a backend chosen on one rank only: one error on both, naming each rank's kernels
        assert mixed[0] == "ValueError" and "the kernels (backend= or MEGATRON_RL_PATCHES_BACKEND) differs" in mixed[1]
        assert f"rank 0: {tiles_route}, rank 1: invariant (InvariantTriton)" in mixed[1], mixed
        assert len(splits) == 3 * 2 + 2, splits  # fp32: routes x modes; bf16: the fused head's two
        assert all(same for (_, _, invariant), (same, _) in splits.items() if invariant), splits
        assert all((used > 0) is invariant for (_, _, invariant), (_, used) in splits.items()), splits
        cols = slice(rank * per, (rank + 1) * per)
        assert len(cases) == len(want) == 6
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
