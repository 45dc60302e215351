"""A fixed set of inputs for the ops and what they return (outputs and gradients): written once
from a reference commit and compared bitwise by test_golden.py / test_golden_tp.py, so refactors
of the ops cannot change a single bit of their results.

What the bits rest on, and how each is held fixed (docs/testing.md, "Golden results"):
- the matrix products (the fused head's logits tiles and its gradients): a BLAS sums them in an
  order that follows the CPU and the thread count, so the cases run under `FixedOrderGemm`
  (tests/kit/fixed_gemm.py), the same bits on every CPU at every thread count;
- the vector math of MKL (torch.exp and torch.log of a CPU float tensor are MKL's vsExp / vsLn):
  MKL picks its code by the CPU's vendor and features (an Intel Xeon's AVX-512 path gives other
  bits than an AMD EPYC's, both "AVX512" to torch), so the cases run in a fresh process started
  with `MKL_CBWR=COMPATIBLE` (MKL's reproducibility mode: one code path on every x86 CPU; MKL
  reads it once, at its first call, so it cannot be set in a process that ran MKL already);
- torch's vectorized kernels (sums, max, softmax's exp): another order on AVX2 than on AVX-512, per
  element the same on every CPU of one capability; so the results are recorded once per capability
  torch dispatches to (`torch.backends.cpu.get_cpu_capability()`: "AVX2" and "AVX512", the
  second natively on an AVX-512 CPU, the first there with ATEN_CPU_CAPABILITY=avx2), and compared
  bitwise on either; on a capability or a torch release not recorded, within the dtype's default
  tolerance of the AVX2 results.

Recording (from the reference commit, each capability in a process of its own; each run replaces
its capability's results in the files and keeps the other's):

    python tests/kit/golden_cases.py                          # this CPU's capability
    ATEN_CPU_CAPABILITY=avx2 python tests/kit/golden_cases.py  # AVX2, on an AVX-512 CPU
"""
from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script (tests/ is on pytest's path)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kit.fixed_gemm import FixedOrderGemm  # noqa: E402
from megatron_rl_patches.testing.environ import environment  # noqa: E402

# the recorded files stay in tests/ops/data/ (the path the issues and the lead name)
DATA = Path(__file__).resolve().parents[1] / "ops" / "data"
SINGLE, TP = DATA / "golden_ops.pt", DATA / "golden_ops_tp.pt"
# MKL's conditional numerical reproducibility: the same code path on every x86 CPU (its SSE2 one)
PINNED = {"MKL_CBWR": "COMPATIBLE"}
FALLBACK = "AVX2"  # the results compared within tolerance where this capability or torch was not recorded


def machine() -> tuple[str, str]:
    """(the capability torch dispatches to here, the torch release)."""
    return torch.backends.cpu.get_cpu_capability(), torch.__version__.split("+")[0]


def recorded(path: Path) -> tuple[Any, bool]:
    """The results recorded in `path` for this machine's capability and bitwise=True, or the
    fallback's and bitwise=False (a capability or torch release not recorded)."""
    files = torch.load(path)
    capability, release = machine()
    if release == files["torch"] and capability in files["cases"]:
        return files["cases"][capability], True
    return files["cases"][FALLBACK], False


def assert_same(before: torch.Tensor, after: torch.Tensor, key: object, bitwise: bool) -> None:
    """Bitwise equal (`bitwise`: the results of this capability and torch release), else close."""
    assert before.dtype == after.dtype and before.shape == after.shape, key
    if bitwise:
        assert torch.equal(before.nan_to_num(), after.nan_to_num()), key
    else:
        torch.testing.assert_close(after, before, equal_nan=True, msg=lambda m: f"{key}: {m}")


def pinned(fn: Any, world_size: int) -> list[Any]:
    """`fn(rank, world_size)` on `world_size` fresh processes (gloo ranks) started with MKL's code
    path pinned (`PINNED`); their results by rank. The caller's environment is left as it was."""
    from megatron_rl_patches.testing.multirank import run_multirank

    with environment(PINNED):  # spawn: a fresh interpreter, whose MKL reads MKL_CBWR at its first call
        return run_multirank(fn, world_size, start_method="spawn")


def single_cases(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """`cases()` as a rank function of `pinned` (one rank)."""
    return cases()


def cases() -> dict[str, torch.Tensor]:
    """Every single-process case, its products in the fixed order."""
    with FixedOrderGemm():
        return unfixed_cases()


def unfixed_cases() -> dict[str, torch.Tensor]:
    from megatron_rl_patches.ops.logprobs import log_probs_and_entropy
    from megatron_rl_patches.ops.topk import topk_ids, topk_logprobs, topk_opd_loss

    out: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(20261122)
    for name, dtype, scale in (("fp32", torch.float32, 3.0), ("fp64", torch.float64, 3.0), ("big", torch.float32, 40.0),
                               ("bf16", torch.bfloat16, 3.0)):
        T, V, k = 23, 127, 5
        base = (torch.randn(T, V, generator=g, dtype=torch.float64) * scale).to(dtype)
        tokens = torch.randint(0, V - 11, (T,), generator=g)
        a = torch.randn(T, generator=g, dtype=torch.float64)
        b = torch.randn(T, generator=g, dtype=torch.float64) * 0.3
        keep = torch.rand(T, V, generator=g) < 0.5
        tau = torch.rand(T, generator=g, dtype=torch.float64) + 0.5
        for label, kwargs in (("plain", {}), ("tau", {"temperature": 0.7}),
                              ("tautensor", {"temperature": tau.to(dtype) if dtype != torch.bfloat16 else tau.float()}),
                              ("keep", {"keep_mask": keep}), ("chunk", {"chunk_size": 4}),
                              ("vocab", {"vocab_size": 120})):
            logits = base.clone().requires_grad_()
            lp, ent = log_probs_and_entropy(logits, tokens, with_entropy=True, **kwargs)
            ((a.to(lp.dtype) * lp).sum() + (b.to(ent.dtype) * ent).sum()).backward()
            out[f"lp/{name}/{label}"] = lp.detach()
            out[f"ent/{name}/{label}"] = ent.detach()
            out[f"lp_grad/{name}/{label}"] = logits.grad
        ids = topk_ids(base, k)
        out[f"ids/{name}"] = ids
        logits = base.clone().requires_grad_()
        tlp, tail = topk_logprobs(logits, ids, temperature=0.9)
        ((torch.randn(T, k, generator=g, dtype=torch.float64).to(tlp.dtype) * tlp).sum() + tail.sum()).backward()
        out[f"topk_lp/{name}"], out[f"topk_tail/{name}"], out[f"topk_grad/{name}"] = (
            tlp.detach(), tail.detach(), logits.grad)
        teachers = torch.stack([torch.log_softmax(base.double() * w, -1).gather(-1, ids) for w in (0.8, 1.3)]).to(dtype)
        t_tail = torch.log1p(-teachers.double().exp().sum(-1).clamp(max=1 - 1e-6)).to(dtype)
        for kl in ("reverse", "forward", "mixed"):
            for tails in ("given", "derived"):
                logits = base.clone().requires_grad_()
                with warnings.catch_warnings():  # cases recorded with the deprecated kl=/mix=
                    warnings.filterwarnings("ignore", "kl=/mix= are deprecated", DeprecationWarning)
                    loss = topk_opd_loss(logits, ids, teachers, t_tail if tails == "given" else None,
                                         teacher_weights=[0.3, 0.7], kl=kl, mix=0.4)
                loss.sum().backward()
                out[f"opd/{name}/{kl}/{tails}"], out[f"opd_grad/{name}/{kl}/{tails}"] = loss.detach(), logits.grad
    _logprob_modes(out, g)
    _topk_modes(out, g)
    _lm_head_modes(out, g)
    _packing_modes(out)
    return out


def _logprob_modes(out: dict[str, torch.Tensor], g: torch.Generator) -> None:
    """log_probs_and_entropy modes the first sweep leaves out: gradient of the log-prob only
    (plain and masked, with far-shift kept rows), entropy without gradient, in-place backward."""
    from megatron_rl_patches.ops.logprobs import log_probs_and_entropy

    for name, dtype, scale in (("fp32", torch.float32, 3.0), ("big", torch.float32, 40.0),
                               ("fp16", torch.float16, 3.0)):
        T, V = 19, 53
        base = (torch.randn(T, V, generator=g, dtype=torch.float64) * scale).to(dtype)
        base[1, -1] = 90.0  # row 1: the kept ids lie far below the row max (their own shift)
        tokens = torch.randint(0, V - 3, (T,), generator=g)
        keep = torch.rand(T, V, generator=g) < 0.3
        keep[1] = False
        keep[1, :4] = True
        tokens[1] = 2
        a = torch.randn(T, generator=g, dtype=torch.float64)
        b = torch.randn(T, generator=g, dtype=torch.float64) * 0.3
        for label, kwargs, use_b in (
            ("lp_only", {}, False), ("keep_lp_only", {"keep_mask": keep}, False),
            ("keep_ent", {"keep_mask": keep, "with_entropy": True}, True),
            ("keep_tau_chunk", {"keep_mask": keep, "with_entropy": True, "temperature": 1.3, "chunk_size": 3}, True),
            ("ent_nograd", {"with_entropy": True, "entropy_requires_grad": False}, False),
            ("keep_ent_nograd", {"keep_mask": keep, "with_entropy": True, "entropy_requires_grad": False}, False),
            ("inplace", {"with_entropy": True, "inplace_backward": True, "chunk_size": 4}, True),
            ("inplace_keep", {"keep_mask": keep, "inplace_backward": True, "vocab_size": 50}, False),
            ("ent_grad_only", {"with_entropy": True}, "only"),
        ):
            leaf = base.clone().requires_grad_()
            logits = leaf * 1  # a non-leaf: in-place backward may overwrite it
            lp, ent = log_probs_and_entropy(logits, tokens, **kwargs)
            loss = (a.to(lp.dtype) * lp).sum() if use_b != "only" else lp.new_zeros(())
            if use_b:
                loss = loss + (b.to(ent.dtype) * ent).sum()
            loss.backward()
            out[f"lp/{name}/{label}"] = lp.detach()
            if ent is not None:
                out[f"ent/{name}/{label}"] = ent.detach()
            out[f"lp_grad/{name}/{label}"] = leaf.grad


def _topk_modes(out: dict[str, torch.Tensor], g: torch.Generator) -> None:
    """top-k log-probs with a tail far below the ids, per-token temperature, chunks, one gradient
    at a time; topk_ids with ties and padding."""
    from megatron_rl_patches.ops.topk import topk_ids, topk_logprobs

    T, V, k = 17, 41, 4
    base = torch.randn(T, V, generator=g, dtype=torch.float64) * 3.0
    base[2, :k] += 80.0  # row 2: the tail lies far below the ids (its own shift)
    base[3] = torch.round(base[3])  # ties at the cut
    base[4] = 1.0
    for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64), ("bf16", torch.bfloat16)):
        logits0 = base.to(dtype)
        ids = topk_ids(logits0, k, vocab_size=V - 2)
        out[f"topk_ids_pad/{name}"] = ids
        tau = torch.rand(T, generator=g, dtype=torch.float64) + 0.5
        weights = torch.randn(T, k, generator=g, dtype=torch.float64)
        for label, kwargs, grads in (("tau_chunk",
                                      {"temperature": tau.float() if dtype == torch.bfloat16 else tau.to(dtype),
                                       "chunk_size": 5, "vocab_size": V - 2}, "both"),
                                     ("lp_only", {}, "lp"), ("tail_only", {"temperature": 1.7}, "tail")):
            logits = logits0.clone().requires_grad_()
            tlp, tail = topk_logprobs(logits, ids, **kwargs)
            loss = tlp.new_zeros(())
            if grads in ("both", "lp"):
                loss = loss + (weights.to(tlp.dtype) * tlp).sum()
            if grads in ("both", "tail"):
                loss = loss + 0.7 * tail.sum()
            loss.backward()
            out[f"topk_lp/{name}/{label}"], out[f"topk_tail/{name}/{label}"] = tlp.detach(), tail.detach()
            out[f"topk_grad/{name}/{label}"] = logits.grad


def _lm_head_modes(out: dict[str, torch.Tensor], g: torch.Generator) -> None:
    """The fused LM head: log-probs/entropy in every mode, top-k ids and top-k log-probs."""
    from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy, lm_head_topk_ids, lm_head_topk_logprobs

    T, H, V, k = 21, 9, 47, 4
    for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64), ("bf16", torch.bfloat16)):
        hidden0 = (torch.randn(T, H, generator=g, dtype=torch.float64) * 2).to(dtype)
        weight0 = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
        tokens = torch.randint(0, V - 3, (T,), generator=g)
        keep = torch.rand(T, V, generator=g) < 0.3
        tau = torch.rand(T, generator=g, dtype=torch.float64) + 0.5
        a = torch.randn(T, generator=g, dtype=torch.float64)
        b = torch.randn(T, generator=g, dtype=torch.float64) * 0.3
        tau_t = tau.float() if dtype == torch.bfloat16 else tau.to(dtype)
        for label, kwargs, use_b in (
            ("plain", {"with_entropy": True}, True), ("lp_only", {}, False),
            ("tau", {"with_entropy": True, "temperature": tau_t, "chunk_size": 4}, True),
            ("keep", {"with_entropy": True, "keep_mask": keep, "vocab_size": V - 3}, True),
            ("keep_lp_only", {"keep_mask": keep, "temperature": 0.8}, False),
            ("ent_nograd", {"with_entropy": True, "entropy_requires_grad": False}, False),
        ):
            hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
            lp, ent = lm_head_log_probs_and_entropy(hidden, weight, tokens, **kwargs)
            loss = (a.to(lp.dtype) * lp).sum()
            if use_b:
                loss = loss + (b.to(ent.dtype) * ent).sum()
            loss.backward()
            out[f"lmh_lp/{name}/{label}"] = lp.detach()
            if ent is not None:
                out[f"lmh_ent/{name}/{label}"] = ent.detach()
            out[f"lmh_grad_h/{name}/{label}"], out[f"lmh_grad_w/{name}/{label}"] = hidden.grad, weight.grad
        if dtype != torch.float64:
            ids = lm_head_topk_ids(hidden0, weight0, k, vocab_size=V - 3, chunk_size=5)
            out[f"lmh_topk_ids/{name}"] = ids
        else:
            ids = torch.stack([torch.randperm(V - 3, generator=g)[:k] for _ in range(T)])
        for label, kwargs in (("plain", {}), ("tau", {"temperature": tau_t, "vocab_size": V - 3, "chunk_size": 6})):
            hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
            tlp, tail = lm_head_topk_logprobs(hidden, weight, ids, **kwargs)
            (tlp.sum() * 0.5 + tail.sum()).backward()
            out[f"lmh_topk_lp/{name}/{label}"], out[f"lmh_topk_tail/{name}/{label}"] = tlp.detach(), tail.detach()
            out[f"lmh_topk_grad_h/{name}/{label}"], out[f"lmh_topk_grad_w/{name}/{label}"] = hidden.grad, weight.grad


def _packing_modes(out: dict[str, torch.Tensor]) -> None:
    """Response pieces and shifted targets of every layout, as integer tensors."""
    from megatron_rl_patches.ops.packing import PackedLayout, response_pieces, shifted_targets

    totals, responses = (9, 4, 13, 6), (3, 0, 5, 5)
    tokens = [torch.arange(100 * i, 100 * i + n) for i, n in enumerate(totals)]
    layouts = {"thd": (PackedLayout(totals, responses), sum(totals) + 2),
               "bshd": (PackedLayout(totals, responses, qkv_format="bshd", max_seq_len=14), 4 * 14)}
    for cp in (2, 3):
        for rank in range(cp):
            zig = PackedLayout(totals, responses, cp_size=cp, cp_rank=rank)
            layouts[f"zigzag{cp}/{rank}"] = (zig, sum(zig.sample_rows(t) for t in totals))
            zig_bshd = PackedLayout(totals, responses, cp_size=cp, cp_rank=rank, qkv_format="bshd", max_seq_len=14)
            layouts[f"zigzag_bshd{cp}/{rank}"] = (zig_bshd, sum(zig_bshd.sample_rows(t) for t in totals))
            rows = -(-sum(totals) // cp)
            layouts[f"allgather{cp}/{rank}"] = (PackedLayout(totals, responses, cp_size=cp, cp_rank=rank,
                                                             allgather_cp=True), rows)
    for label, (layout, rows) in layouts.items():
        pieces = [(i, p.start, p.stop, p.offset)
                  for i, sample in enumerate(response_pieces(layout, rows)) for p in sample]
        out[f"pieces/{label}"] = torch.tensor(pieces, dtype=torch.long).reshape(-1, 4)
        out[f"targets/{label}"] = shifted_targets(tokens, layout, rows)


def tp_cases(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's outputs and gradients of the vocab-parallel ops on its vocab shard (run on
    `world_size` gloo ranks by test_golden_tp.py): the cross-rank combine is recorded too; its
    products in the fixed order."""
    with FixedOrderGemm():
        return unfixed_tp_cases(rank, world_size)


def unfixed_tp_cases(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy, lm_head_topk_ids, lm_head_topk_logprobs
    from megatron_rl_patches.ops.logprobs import log_probs_and_entropy
    from megatron_rl_patches.ops.topk import topk_ids, topk_logprobs, topk_opd_loss

    group = dist.group.WORLD
    out: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(7)
    T, V_LOCAL, H, k = 16, 13, 7, 4
    vocab = V_LOCAL * world_size
    shard = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64), ("bf16", torch.bfloat16)):
        full = torch.randn(T, vocab, generator=g, dtype=torch.float64) * 3.0
        full[1, -1] = 90.0  # row 1: kept ids and the top-k tail far below the row max
        full[2, :] = -math.inf
        full[2, 5] = 0.5  # row 2: one finite logit, on rank 0 only
        tokens = torch.randint(0, vocab - 3, (T,), generator=g)
        tokens[1], tokens[2] = 2, 5
        keep = torch.rand(T, vocab, generator=g) < 0.3
        keep[1] = False
        keep[1, :4] = True
        a = torch.randn(T, generator=g, dtype=torch.float64)
        b = torch.randn(T, generator=g, dtype=torch.float64) * 0.3
        tau = torch.rand(T, generator=g, dtype=torch.float64) + 0.5
        tau_t = tau.float() if dtype == torch.bfloat16 else tau.to(dtype)
        base = full.to(dtype)[:, shard].contiguous()
        for label, kwargs, use_b in (
            ("plain", {"with_entropy": True}, True), ("lp_only", {}, False),
            ("keep", {"with_entropy": True, "keep_mask": keep[:, shard]}, True),
            ("keep_lp_only", {"keep_mask": keep[:, shard], "temperature": tau_t}, False),
            ("tau_vocab", {"with_entropy": True, "temperature": tau_t, "vocab_size": vocab - 3, "chunk_size": 3}, True),
            ("ent_nograd", {"with_entropy": True, "entropy_requires_grad": False}, False),
        ):
            logits = base.clone().requires_grad_()
            lp, ent = log_probs_and_entropy(logits, tokens, tp_group=group, **kwargs)
            loss = (a.to(lp.dtype) * lp).sum() + ((b.to(ent.dtype) * ent).sum() if use_b else 0.0)
            loss.backward()
            out[f"lp/{name}/{label}"], out[f"lp_grad/{name}/{label}"] = lp.detach(), logits.grad
            if ent is not None:
                out[f"ent/{name}/{label}"] = ent.detach()
        finite = full.clone()
        finite[2] = torch.arange(vocab, dtype=torch.float64)
        finite[3] = 1.0  # ties across ranks
        finite_base = finite.to(dtype)[:, shard].contiguous()
        ids = topk_ids(finite_base, k, tp_group=group, vocab_size=vocab - 3)
        out[f"topk_ids/{name}"] = ids
        logits = finite_base.clone().requires_grad_()
        tlp, tail = topk_logprobs(logits, ids, tp_group=group, temperature=tau_t, vocab_size=vocab - 3)
        (tlp.sum() * 0.5 + tail.sum()).backward()
        out[f"topk_lp/{name}"], out[f"topk_tail/{name}"], out[f"topk_grad/{name}"] = (
            tlp.detach(), tail.detach(), logits.grad)
        teachers = torch.log_softmax(finite * 0.7, -1).gather(-1, ids).to(dtype)
        logits = finite_base.clone().requires_grad_()
        loss = topk_opd_loss(logits, ids, teachers, kl="mixed", mix=0.3, tp_group=group, chunk_size=5)
        loss.sum().backward()
        out[f"opd/{name}"], out[f"opd_grad/{name}"] = loss.detach(), logits.grad

        hidden0 = (torch.randn(T, H, generator=g, dtype=torch.float64) * 2).to(dtype)
        weight0 = torch.randn(vocab, H, generator=g, dtype=torch.float64).to(dtype)[shard].contiguous()
        for sp in (False, True):
            rows = slice(rank * T // world_size, (rank + 1) * T // world_size) if sp else slice(None)
            for label, kwargs in (("plain", {"with_entropy": True}),
                                  ("keep_tau", {"with_entropy": True, "keep_mask": keep[:, shard], "temperature": tau_t,
                                                "vocab_size": vocab - 3, "chunk_size": 5})):
                hidden, weight = hidden0[rows].clone().requires_grad_(), weight0.clone().requires_grad_()
                lp, ent = lm_head_log_probs_and_entropy(hidden, weight, tokens, tp_group=group, sequence_parallel=sp,
                                                        **kwargs)
                ((a.to(lp.dtype) * lp).sum() + (b.to(ent.dtype) * ent).sum()).backward()
                key = f"{name}/sp{int(sp)}/{label}"
                out[f"lmh_lp/{key}"], out[f"lmh_ent/{key}"] = lp.detach(), ent.detach()
                out[f"lmh_grad_h/{key}"], out[f"lmh_grad_w/{key}"] = hidden.grad, weight.grad
            if dtype != torch.float64:
                ids = lm_head_topk_ids(hidden0[rows], weight0, k, tp_group=group, sequence_parallel=sp,
                                       vocab_size=vocab - 3)
                out[f"lmh_topk_ids/{name}/sp{int(sp)}"] = ids
            hidden, weight = hidden0[rows].clone().requires_grad_(), weight0.clone().requires_grad_()
            tlp, tail = lm_head_topk_logprobs(hidden, weight, ids, tp_group=group, sequence_parallel=sp,
                                              temperature=0.8, vocab_size=vocab - 3)
            (tlp.sum() * 0.5 + tail.sum()).backward()
            key = f"{name}/sp{int(sp)}"
            out[f"lmh_topk_lp/{key}"], out[f"lmh_topk_tail/{key}"] = tlp.detach(), tail.detach()
            out[f"lmh_topk_grad_h/{key}"], out[f"lmh_topk_grad_w/{key}"] = hidden.grad, weight.grad
    return out


def record(path: Path, results: Any) -> None:
    """`results` stored in `path` as this machine's capability's, beside the others recorded with
    the same torch release."""
    capability, release = machine()
    files = torch.load(path) if path.exists() else {"torch": release, "cases": {}}
    if files["torch"] != release:
        files = {"torch": release, "cases": {}}
    files["cases"][capability] = results
    torch.save(files, path)
    print(f"{path}: {capability} recorded (torch {release}; recorded: {', '.join(sorted(files['cases']))})")


if __name__ == "__main__":
    record(TP, pinned(tp_cases, 2))
    record(SINGLE, pinned(single_cases, 1)[0])
