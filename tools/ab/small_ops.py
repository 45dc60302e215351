"""For `../shared/tools/ab-bench REV_A REV_B -- python tools/ab/small_ops.py`: the per-call overhead
of each op at a small size, where fixed costs (checks, row selection, dispatch) dominate: the best
of 300 calls after 20 warm-up calls, forward (+ backward for the logits ops), CPU, 1 thread, fp32,
T=64, V=512, H=32, k=4, with and without row_mask. One JSON line (microseconds)."""
from __future__ import annotations

import json
import time

import torch

from megatron_rl_patches import (
    lm_head_divergence,
    lm_head_log_probs_and_entropy,
    lm_head_topk_ids,
    lm_head_topk_logprobs,
    log_probs_and_entropy,
    topk_ids,
    topk_logprobs,
)

torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
T, V, H, K = 64, 512, 32, 4
x = torch.randn(T, V, generator=g)
h, w = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g)
th, tw = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g)
tokens = torch.randint(0, V, (T,), generator=g)
ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(T)])
mask = torch.rand(T, generator=g) < 0.5


def fb(fn):
    def run():
        xx = x.clone().requires_grad_(True)
        out = fn(xx)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
    return run


cases = {
    "log_probs": fb(lambda xx: log_probs_and_entropy(xx, tokens, with_entropy=True)),
    "log_probs_masked": fb(lambda xx: log_probs_and_entropy(xx, tokens, with_entropy=True, row_mask=mask)),
    "topk_logprobs": fb(lambda xx: topk_logprobs(xx, ids)),
    "topk_ids": lambda: topk_ids(x, K),
    "lm_head_log_probs": lambda: lm_head_log_probs_and_entropy(h, w, tokens, row_mask=mask),
    "lm_head_topk_ids": lambda: lm_head_topk_ids(h, w, K, row_mask=mask),
    "lm_head_topk_logprobs": lambda: lm_head_topk_logprobs(h, w, ids, row_mask=mask),
    "lm_head_divergence": lambda: lm_head_divergence(h, w, th, tw, row_mask=mask),
}
result = {}
for name, run in cases.items():
    for _ in range(20):
        run()
    best = float("inf")
    for _ in range(300):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    result[name + "_us"] = round(best * 1e6, 1)
print(json.dumps(result))
