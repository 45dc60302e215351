"""For `../shared/tools/ab-bench REV_A REV_B -- python tools/ab/agreement_ops.py`: one JSON line, the
seconds of `log_probs_and_entropy` and `lm_head_log_probs_and_entropy` (forward with entropy +
`torch.autograd.grad` to the logits / hidden states and weight), best of 2 calls per process, at
world size 1 ("*_tp1") and at TP = 2 over gloo ("*_tp2": rank 0's, each rank its vocabulary half;
the ranks' agreement step, which carries the arguments that must match, included). CPU, 1 thread,
fp32, T=1024, V=32000, H=128."""
from __future__ import annotations

import json
import time
import warnings

import torch

T, V, H, CALLS = 1024, 32000, 128, 2


def timed(rank: int, world: int) -> dict[str, float]:
    """Best-of-CALLS seconds of each op on this rank's vocabulary shard (the whole one at world 1)."""
    import torch.distributed as dist

    from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy
    from megatron_rl_patches.ops.logprobs import log_probs_and_entropy

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    group = dist.group.WORLD if world > 1 else None
    g = torch.Generator().manual_seed(0)
    shard = slice(rank * V // world, (rank + 1) * V // world)
    logits = torch.randn(T, V, generator=g)[:, shard].contiguous().requires_grad_(True)
    hidden = torch.randn(T, H, generator=g).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) / H**0.5)[shard].contiguous().requires_grad_(True)
    tokens = torch.randint(0, V, (T,), generator=g)
    ops = {
        "log_probs": (lambda: log_probs_and_entropy(logits, tokens, tp_group=group, with_entropy=True), [logits]),
        "lm_head": (lambda: lm_head_log_probs_and_entropy(hidden, weight, tokens, tp_group=group, with_entropy=True),
                    [hidden, weight]),
    }
    out: dict[str, float] = {}
    for name, (call, inputs) in ops.items():
        best = float("inf")
        for _ in range(CALLS):
            if group is not None:
                dist.barrier()
            start = time.perf_counter()
            log_probs, entropy = call()
            torch.autograd.grad((log_probs.sum() + entropy.sum()), inputs)
            best = min(best, time.perf_counter() - start)
        out[f"{name}_tp{world}"] = round(best, 4)
    return out


def main() -> None:
    from megatron_rl_patches.testing.multirank import run_multirank

    out = timed(0, 1)
    out.update(run_multirank(timed, 2, timeout=300)[0])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
