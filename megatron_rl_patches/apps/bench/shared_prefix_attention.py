"""`bench shared-prefix-attention`: shared-prefix packing's attention on CUDA (FlexAttention under a
block mask made from the sharing plan, compiled) against the unshared path's attention (each sample
whole: G sequences of P + R, causal, through torch's scaled dot-product attention, whose CUDA kernels are
flash attention's), forward + backward in bfloat16, at P = 4,096, R = 512, G = 8 (32 heads of 128,
8 key/value groups). What `tools/gpu-check` times when a GPU is at hand (not part of `bench all`).

Rows: the attention (column `attention`), the rows attended, the median forward + backward time over
`runs` after a warm-up (CUDA events), its ratio to the unshared row, the CUDA allocator's peak above the inputs. Without
CUDA, `--quick` runs both forward only on CPU (FlexAttention has no CPU backward), which says
nothing of speed and checks the harness: its rows give no time and no ratio, and torch's advice to
compile FlexAttention is not printed; the full run says it needs CUDA and exits non-zero."""
# lazy imports: import cost: torch loads when the benchmark runs
from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

from megatron_rl_patches.apps.bench import outputs
from megatron_rl_patches.apps.bench.measure import MIB

FULL: dict[str, Any] = {"prompt": 4096, "response": 512, "group": 8, "heads": 32, "groups": 8, "width": 128,
                        "runs": 5}
QUICK: dict[str, Any] = {"prompt": 64, "response": 16, "group": 4, "heads": 4, "groups": 2, "width": 16, "runs": 1}
COLUMNS = ("attention", "rows", "ms", "vs_unshared", "peak_MiB", "note")
NO_SPEED = "CPU, forward only: the harness ran; no time, no speed figure"


def routes(plan: dict, device: str, dtype: Any) -> dict[str, tuple[int, Any]]:
    """route -> (rows, fn(train) running it once)."""
    import torch
    import torch.nn.functional as F

    from megatron_rl_patches.shared_prefix import plan_shared_prefix, shared_prefix_attention

    p, r, g = plan["prompt"], plan["response"], plan["group"]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (p,), generator=gen)
    samples = [torch.cat([prompt, torch.randint(0, 1000, (r,), generator=gen)]) for _ in range(g)]
    shared = plan_shared_prefix(torch.cat(samples), [i * (p + r) for i in range(g + 1)])
    scale = plan["width"] ** -0.5

    def tensors(rows: int, batch: int = 1) -> list[Any]:
        shapes = [(rows, batch, plan["heads"], plan["width"])] + [(rows, batch, plan["groups"], plan["width"])] * 2
        return [torch.randn(*shape, device=device, dtype=dtype) for shape in shapes]

    planned_inputs, unshared_inputs = tensors(shared.physical_length), tensors(p + r, g)

    def planned(train: bool) -> None:
        q, k, v = (t.detach().requires_grad_(train) for t in planned_inputs)
        out = shared_prefix_attention(q, k, v, shared, scale=scale, route="flex")
        if train:
            out.sum().backward()

    def unshared(train: bool) -> None:
        q, k, v = (t.permute(1, 2, 0, 3).detach().requires_grad_(train) for t in unshared_inputs)  # [G, h, P + R, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        if train:
            out.sum().backward()

    return {"unshared (each sample whole)": (g * (p + r), unshared),
            "shared prefix (FlexAttention, block mask)": (shared.physical_length, planned)}


def measure(plan: dict, device: str, train: bool) -> list[dict]:
    import torch

    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for route, (count, fn) in routes(plan, device, dtype).items():
        with warnings.catch_warnings():
            if not cuda:  # torch's advice to compile FlexAttention: on CPU the harness is checked, not timed
                warnings.filterwarnings("ignore", message=r"flex_attention called without torch\.compile",
                                        category=UserWarning)
            fn(train)  # warm-up (FlexAttention compiles its kernels here)
            times = []
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            for _ in range(plan["runs"]):
                started = time.perf_counter()
                fn(train)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
        peak = (torch.cuda.max_memory_allocated() - base) / MIB if cuda else None
        rows.append({"attention": route, "rows": count, "ms": statistics.median(times) * 1e3 if cuda else None,
                     "peak_MiB": peak, "note": "" if cuda else NO_SPEED})
    for row in rows:  # on CPU no time and no ratio: the unfused forward says nothing of the GPU's speed
        row["vs_unshared"] = float(row["ms"]) / float(rows[0]["ms"]) if cuda else None
    return rows


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    """Print the table; write shared_prefix_attention.csv / .md into `out_dir` when given."""
    import torch

    cuda = torch.cuda.is_available()  # without it the command refused the full run (apps/cli/bench.py)
    plan = QUICK if quick else FULL
    rows = measure(plan, "cuda" if cuda else "cpu", train=cuda)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    title = outputs.titled(
        f"shared-prefix attention: P={plan['prompt']}, R={plan['response']}, G={plan['group']}, {plan['heads']} heads "
        f"of {plan['width']} ({plan['groups']} key/value groups), {'bf16 forward + backward' if cuda else 'fp32'}, "
        f"{device}", quick)
    return outputs.reported(rows, COLUMNS, title, out_dir, "shared_prefix_attention")
