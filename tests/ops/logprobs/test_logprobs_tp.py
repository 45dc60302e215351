"""Vocab-parallel log_probs_and_entropy on 2 and 4 gloo ranks equals the single-rank result.

One spawned run per world size checks every configuration (spawning costs seconds); each rank
returns its errors against TP=1 and the float64 reference, the parent asserts on them.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_rl_patches.ops.logprobs import log_probs_and_entropy
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.logprob_reference import reference_log_probs
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = pytest.mark.multirank

T, V_LOCAL = 24, 13


def _full_inputs(world_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vocab = V_LOCAL * world_size
    logits = torch.randn(T, vocab, generator=g) * 3.0
    tokens = torch.randint(0, vocab, (T,), generator=g)
    a, b = torch.randn(T, generator=g), torch.randn(T, generator=g)
    keep = torch.rand(T, vocab, generator=g) < 0.3
    # row 0: every kept id and the target on rank 0, so the other ranks hold no kept id
    keep[0] = False
    keep[0, :3] = True
    tokens[0] = 1
    # row 1: the kept ids lie far below the row max (own-shift path)
    logits[1, -1] = 90.0
    keep[1] = False
    keep[1, :4] = True
    tokens[1] = 2
    return logits, tokens, a, b, keep


def _float64_reference(logits, tokens, a, b, keep=None, temperature=1.0, vocab_size=None):
    leaf = logits.detach().double().requires_grad_()
    lp, ent = reference_log_probs(leaf, tokens, temperature=temperature, keep_mask=keep, vocab_size=vocab_size)
    ((lp * a.double()).sum() + (ent * b.double()).sum()).backward()
    return lp.detach(), ent.detach(), leaf.grad


class _CountAllReduce:
    """Counts dist.all_reduce calls (and the largest tensor) while active."""

    def __enter__(self):
        self.calls, self.largest, self._real = 0, 0, dist.all_reduce

        def counting(tensor, *args, **kwargs):
            self.calls += 1
            self.largest = max(self.largest, tensor.numel())
            return self._real(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


def _run(logits, tokens, a, b, *, group, inplace=False, comm=None, **kwargs):
    base = logits.clone().requires_grad_()
    x = base * 1.0
    with _CountAllReduce() as fwd:
        lp, ent = log_probs_and_entropy(x, tokens, tp_group=group, with_entropy=True, inplace_backward=inplace,
                                        **kwargs)
    loss = (lp * a).sum() + ((ent * b).sum() if ent.requires_grad else 0.0)
    with _CountAllReduce() as bwd:
        loss.backward()
    if comm is not None:
        comm.update(fwd=fwd.calls, bwd=bwd.calls, largest=fwd.largest)
    return lp.detach(), ent.detach(), base.grad


def _tp_worker(rank: int, world_size: int) -> dict[str, float]:
    """Every configuration at TP=world_size on this rank's shard vs TP=1 and float64; max errors."""
    group = dist.new_group(list(range(world_size)))
    logits, tokens, a, b, keep = _full_inputs(world_size)
    lo, hi = rank * V_LOCAL, (rank + 1) * V_LOCAL
    tau = torch.rand(T, generator=torch.Generator().manual_seed(1)) + 0.5
    padded_vocab = (world_size - 1) * V_LOCAL - 2  # last rank: no real column; the one before: partial
    tokens_padded = tokens % padded_vocab
    garbage = logits.clone()
    garbage[:, padded_vocab:] = math.nan
    configs = {
        "plain": dict(),
        "temperature+chunks": dict(temperature=0.7, chunk_size=5),
        "per-token-temperature+inplace": dict(temperature=tau, inplace=True),
        "keep_mask": dict(keep_mask=keep),
        "keep_mask+inplace+chunks": dict(keep_mask=keep, inplace=True, chunk_size=3),
        "vocab_size": dict(vocab_size=padded_vocab),
        "entropy_metric_only": dict(entropy_requires_grad=False),
    }
    errors: dict[str, float] = {}
    for name, cfg in configs.items():
        full, toks = (garbage, tokens_padded) if "vocab_size" in cfg else (logits, tokens)
        shard_kwargs = dict(cfg)
        ref_kwargs = {k: v for k, v in cfg.items() if k != "inplace"}
        if "keep_mask" in cfg:
            shard_kwargs["keep_mask"] = cfg["keep_mask"][:, lo:hi].contiguous()
        comm: dict[str, int] = {}
        lp, ent, grad = _run(full[:, lo:hi].contiguous(), toks, a, b, group=group, comm=comm, **shard_kwargs)
        # one MAX and one SUM all-reduce per call whatever the chunking, none in backward;
        # the SUM packs <= 4 values per row (target logit, sum over the others, moment, kept sum)
        errors[f"{name}/collectives fwd"] = comm["fwd"]
        errors[f"{name}/collectives bwd"] = comm["bwd"]
        errors[f"{name}/collective values per row"] = comm["largest"] / T
        lp1, ent1, grad1 = _run(full, toks, a, b, group=None, **ref_kwargs)
        b_eff = b if cfg.get("entropy_requires_grad", True) else torch.zeros_like(b)
        lp64, ent64, grad64 = _float64_reference(
            full, toks, a, b_eff, keep=cfg.get("keep_mask"), temperature=cfg.get("temperature", 1.0),
            vocab_size=cfg.get("vocab_size"),
        )
        errors[f"{name}/tp1 logp"] = (lp - lp1).abs().max().item()
        errors[f"{name}/tp1 entropy"] = (ent - ent1).abs().max().item()
        errors[f"{name}/tp1 grad"] = (grad - grad1[:, lo:hi]).abs().max().item()
        errors[f"{name}/f64 logp rel"] = ((lp.double() - lp64).abs() / lp64.abs().clamp_min(1)).max().item()
        errors[f"{name}/f64 entropy"] = (ent.double() - ent64).abs().max().item()
        errors[f"{name}/f64 grad rel"] = ((grad.double() - grad64[:, lo:hi]).abs().max() / grad64.abs().max()).item()
    if world_size == 2:
        errors.update(_slime_checks(rank, world_size, logits, tokens, a, b, keep))
    return errors


def _slime_reference(logits, tokens, a, b, keep):
    """slime's unfused math in float64: max-subtract, exp, sum, log; entropy m + log S - Σ p·z."""
    x = logits.double().requires_grad_()
    m = x.max(-1, keepdim=True).values
    ex = (x - m).exp()
    s = ex.sum(-1, keepdim=True)
    p = ex / s
    ent = (m + s.log() - (p * x).sum(-1, keepdim=True)).squeeze(-1)
    kept = keep.clone()
    kept[torch.arange(T), tokens] = True
    xk = x.masked_fill(~kept, -math.inf)
    mk = xk.max(-1, keepdim=True).values
    sk = (xk - mk).exp().sum(-1, keepdim=True)
    lp = (xk.gather(1, tokens[:, None]) - mk - sk.log()).squeeze(-1)
    ((lp * a.double()).sum() + (ent * b.double()).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


def _slime_checks(rank, world_size, logits, tokens, a, b, keep):
    """slime adapter with tp_group=None (slime: the default group) against slime's math in float64."""
    from megatron_rl_patches.integrations.slime import calculate_log_probs_and_entropy

    lo, hi = rank * V_LOCAL, (rank + 1) * V_LOCAL
    base = logits[:, lo:hi].clone().requires_grad_()
    lp, ent = calculate_log_probs_and_entropy(base, tokens, None, with_entropy=True, chunk_size=7,
                                              log_prob_keep_mask=keep[:, lo:hi].contiguous())
    ((lp.squeeze(-1) * a).sum() + (ent * b).sum()).backward()
    lp64, ent64, grad64 = _slime_reference(logits, tokens, a, b, keep)
    return {
        "slime/shape ok": float(lp.shape == (T, 1) and ent.shape == (T,)),
        "slime/f64 logp": (lp.squeeze(-1).double() - lp64).abs().max().item(),
        "slime/f64 entropy": (ent.double() - ent64).abs().max().item(),
        "slime/f64 grad": (base.grad.double() - grad64[:, lo:hi]).abs().max().item(),
    }


def _check(results: list[dict[str, float]]) -> None:
    for rank, errors in enumerate(results):
        for name, err in errors.items():
            if name == "slime/shape ok":
                assert err == 1.0, f"rank {rank}: slime adapter shapes"
            elif name.endswith("/collectives fwd"):
                assert err == 2, f"rank {rank}: {name} = {err}"
            elif name.endswith("/collectives bwd"):
                assert err == 0, f"rank {rank}: {name} = {err}"
            elif name.endswith("/collective values per row"):
                assert err <= 4, f"rank {rank}: {name} = {err}"
            elif "/tp1" in name:
                assert err <= 2e-6, f"rank {rank}: {name} = {err:.3g}"
            elif name.startswith("slime/"):
                assert err <= 1e-6, f"rank {rank}: {name} = {err:.3g}"
            elif "entropy" in name:
                assert err <= 1e-5, f"rank {rank}: {name} = {err:.3g}"
            else:
                assert err <= 1e-6, f"rank {rank}: {name} = {err:.3g}"


@layouts.mark("tp2")
def test_tp2_equals_tp1_and_slime_adapter_at_tp2():
    results = run_multirank(_tp_worker, 2)
    assert any(name.startswith("slime/") for name in results[0])
    _check(results)


def test_tp4_equals_tp1():
    _check(run_multirank(_tp_worker, 4))
