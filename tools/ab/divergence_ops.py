"""For `../shared/tools/ab-bench REV_A REV_B -- python tools/ab/divergence_ops.py [--floor]`: one
JSON line, the seconds of `lm_head_divergence` (forward + `torch.autograd.grad` to the student's
hidden states and weight; one teacher of the student's size), best of 2 calls per process. With
`--floor`, beside each divergence the same tile matmuls alone ("NAME_floor": the recomputes and
the two gradient matmuls, at the torch tiles' shape). CPU, 1 thread, fp32, T=1024, V=32000, H=1024."""
from __future__ import annotations

import json
import sys
import time
import warnings

import torch

from megatron_rl_patches.ops.divergence import lm_head_divergence

T, V, H = 1024, 32000, 1024
TILE_COLS = 2048  # the torch tiles at T=1024: 1024 rows x 2048 columns (8 MiB fp32)
# tile matmuls per call besides the two gradient ones: forward (2 models) + backward recompute (2),
# and 2 more for the divergences with a second pass
RECOMPUTES = {"forward_kl": 4, "mixed_kl": 4, "jsd": 6}


def matmul_floor(h: torch.Tensor, w: torch.Tensor, recomputes: int) -> float:
    buf = torch.empty(T, TILE_COLS)
    grad_h, grad_w = torch.zeros(T, H), torch.zeros(V, H)
    start = time.perf_counter()
    for c0 in range(0, V, TILE_COLS):
        c1 = min(V, c0 + TILE_COLS)
        x = buf[:, : c1 - c0]
        for _ in range(recomputes):
            torch.matmul(h, w[c0:c1].t(), out=x)
        grad_h.addmm_(x, w[c0:c1])
        grad_w[c0:c1].addmm_(x.t(), h)
    return time.perf_counter() - start


def main(floor: bool) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) / H**0.5).requires_grad_(True)
    teacher_h, teacher_w = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g) / H**0.5
    upstream = torch.randn(T, generator=g)
    out: dict[str, float] = {}
    for name, recomputes in RECOMPUTES.items():
        best = best_floor = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            try:
                value = lm_head_divergence(h, w, teacher_h, teacher_w, divergence=name)
            except ValueError:  # a revision without this divergence: no field
                break
            torch.autograd.grad((upstream * value).sum(), [h, w])
            best = min(best, time.perf_counter() - start)
            if floor:
                best_floor = min(best_floor, matmul_floor(h.detach(), w.detach(), recomputes))
        if best == float("inf"):
            continue
        out[name] = round(best, 4)
        if floor:
            out[f"{name}_floor"] = round(best_floor, 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main("--floor" in sys.argv[1:])
