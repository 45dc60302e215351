"""A fixed set of inputs for the ops and what they return (outputs and gradients): written once
from a reference commit (`python tests/ops/golden_cases.py OUT.pt`) and compared bitwise by
test_golden.py, so refactors of the ops cannot change a single bit of their results."""
from __future__ import annotations

import sys

import torch


def cases() -> dict[str, torch.Tensor]:
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
        for label, kwargs in (("plain", {}), ("tau", {"temperature": 0.7}), ("tautensor", {"temperature": tau.to(dtype) if dtype != torch.bfloat16 else tau.float()}),
                              ("keep", {"keep_mask": keep}), ("chunk", {"chunk_size": 4}), ("vocab", {"vocab_size": 120})):
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
        out[f"topk_lp/{name}"], out[f"topk_tail/{name}"], out[f"topk_grad/{name}"] = tlp.detach(), tail.detach(), logits.grad
        teachers = torch.stack([torch.log_softmax(base.double() * w, -1).gather(-1, ids) for w in (0.8, 1.3)]).to(dtype)
        t_tail = torch.log1p(-teachers.double().exp().sum(-1).clamp(max=1 - 1e-6)).to(dtype)
        for kl in ("reverse", "forward", "mixed"):
            for tails in ("given", "derived"):
                logits = base.clone().requires_grad_()
                loss = topk_opd_loss(logits, ids, teachers, t_tail if tails == "given" else None,
                                     teacher_weights=[0.3, 0.7], kl=kl, mix=0.4)
                loss.sum().backward()
                out[f"opd/{name}/{kl}/{tails}"], out[f"opd_grad/{name}/{kl}/{tails}"] = loss.detach(), logits.grad
    return out


if __name__ == "__main__":
    torch.save(cases(), sys.argv[1])
