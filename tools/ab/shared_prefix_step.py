"""For `../shared/tools/ab-bench REV_A REV_B -- .venv/bin/python tools/ab/shared_prefix_step.py`: one GRPO
micro-batch (P = 512, R = 64, G = 8, two groups) planned and run through a small GPTModel (Qwen3's
proportions, 2 layers x 256, 4 heads, 2 key/value groups) under its sharing plan, CPU, 1 thread, fp32:
the plan's making, the forward and the training step (forward + backward of the log-probs), the median
of 5 after 2 warm-ups. Public names only (they are the same at both revisions). One JSON line
(milliseconds)."""
from __future__ import annotations

import json
import statistics
import time

import torch

from megatron_rl_patches.shared_prefix import plan_shared_prefix, prepare_shared_prefix, shared_prefix_params
from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config
from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

P, R, G, GROUPS, VOCAB = 512, 64, 8, 2, 64  # the kit's vocabulary (TINY_VOCAB)
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
samples = []
for _ in range(GROUPS):
    prompt = torch.randint(0, VOCAB, (P,), generator=g)
    samples += [torch.cat([prompt, torch.randint(0, VOCAB, (R,), generator=g)]) for _ in range(G)]
tokens = torch.cat(samples)[None]
cu = torch.tensor([0] + [(P + R) * (i + 1) for i in range(len(samples))], dtype=torch.int32)
labels = torch.roll(tokens, -1, 1)


def median_ms(run, rounds: int = 5, warm: int = 2) -> float:
    times = []
    for i in range(warm + rounds):
        t0 = time.perf_counter()
        run()
        if i >= warm:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


with megatron_on_cpu():
    config = tiny_gpt_config(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                             kv_channels=64, ffn_hidden_size=768, gated_linear_unit=True,
                             activation_func=torch.nn.functional.silu, normalization="RMSNorm", qk_layernorm=True,
                             add_bias_linear=False)
    model = prepare_shared_prefix(build_packed_gpt(seq_length=P + R, seed=0, config=config))
    plan = plan_shared_prefix(tokens, cu)
    params = shared_prefix_params(plan)

    def forward():
        with torch.no_grad():
            model(tokens, None, None, labels=labels, packed_seq_params=params)

    def step():
        model.zero_grad(set_to_none=True)
        model(tokens, None, None, labels=labels, packed_seq_params=params).float().mean().backward()

    result = {"plan_ms": median_ms(lambda: plan_shared_prefix(tokens, cu)), "forward_ms": median_ms(forward),
              "step_ms": median_ms(step), "physical_rows": float(plan.physical_length)}
print(json.dumps(result))
