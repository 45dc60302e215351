"""For `../shared/tools/ab-bench REV_A REV_B -- python tools/ab/logits_ops.py`: one JSON line, the
seconds of each logits op alone (forward + `torch.autograd.grad`), best of 2 calls per process, a
fresh [T, V] input per call prepared outside the clock. CPU, 1 thread, fp32, T=4096, V=32000, k=8."""
from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable

import torch

from megatron_rl_patches.ops import logprobs, topk

T, V, K = 4096, 32000, 8


def best_of(prepare: Callable[[], torch.Tensor], run: Callable[[torch.Tensor], object], calls: int = 2) -> float:
    best = float("inf")
    for _ in range(calls):
        x = prepare()
        start = time.perf_counter()
        run(x)
        best = min(best, time.perf_counter() - start)
        del x
    return round(best, 4)


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(T, V, generator=g) * 3
    tokens = torch.randint(0, V, (T,), generator=g)
    a, b = torch.randn(T, generator=g), torch.randn(T, generator=g)
    ids = torch.arange(K) * (V // K) + torch.randint(0, V // K, (T, 1), generator=g)

    def leaf() -> torch.Tensor:
        return base.clone().requires_grad_(True) * 1.0  # a non-leaf, as a model's logits are

    def log_probs(x: torch.Tensor, inplace: bool) -> None:
        lp, ent = logprobs.log_probs_and_entropy(x, tokens, with_entropy=True, inplace_backward=inplace)
        torch.autograd.grad((a * lp).sum() + (b * ent).sum(), x)

    def topk_lp(x: torch.Tensor) -> None:
        lp, tail = topk.topk_logprobs(x, ids)
        torch.autograd.grad(lp.sum() + (a * tail).sum(), x)

    print(json.dumps({
        "log_probs_and_entropy": best_of(leaf, lambda x: log_probs(x, False)),
        "log_probs_and_entropy_inplace": best_of(leaf, lambda x: log_probs(x, True)),
        "topk_logprobs": best_of(leaf, topk_lp),
        "topk_ids": best_of(lambda: base, lambda x: topk.topk_ids(x, K), calls=3),
    }))


if __name__ == "__main__":
    main()
