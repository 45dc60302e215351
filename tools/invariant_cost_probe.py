"""The invariant logits op's cost against the default's, each mode in fresh processes, alternating:
``log_probs_and_entropy`` forward + backward (the gradient of the logits), T = 1024, V = 151,936,
fp32, one thread. Per process STEPS steps, the first dropped; per round the median step's wall,
thread CPU and system time; printed per mode with the invariant / default ratio of the medians.

    .venv/bin/python tools/invariant_cost_probe.py [ROUNDS]      # default 6 rounds
    MEGATRON_RL_PATCHES_NATIVE=0 .venv/bin/python tools/invariant_cost_probe.py 4   # the torch tiles

Run from the repository root (the package there is the one timed)."""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

T, V, STEPS = 1024, 151936, 5
MEASURES = ("wall", "thread", "sys")


def steps(invariant: bool) -> list[dict[str, float]]:
    """STEPS timed steps in this process."""
    import torch

    from megatron_rl_patches.ops import logprobs

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (T,), generator=g)
    a, b = torch.randn(T, generator=g), torch.randn(T, generator=g)
    base = torch.randn(T, V, generator=g) * 3
    out = []
    for _ in range(STEPS):
        leaf = base.clone().requires_grad_(True)
        x = leaf * 1.0  # a non-leaf, as a model's logits
        before, wall, thread = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.thread_time()
        lp, ent = logprobs.log_probs_and_entropy(x, tokens, with_entropy=True, invariant=invariant)
        assert ent is not None  # with_entropy
        torch.autograd.grad((a * lp).sum() + (b * ent).sum(), [x])
        after = resource.getrusage(resource.RUSAGE_SELF)
        out.append({"wall": time.perf_counter() - wall, "thread": time.thread_time() - thread,
                    "sys": after.ru_stime - before.ru_stime})
    return out


def one_process(mode: str) -> dict[str, float]:
    """The median step (the first dropped) of a fresh process running `mode`."""
    done = subprocess.run([sys.executable, __file__, "--worker", mode], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    timed = json.loads(done.stdout)[1:]
    return {key: statistics.median(step[key] for step in timed) for key in MEASURES}


def main(rounds: int) -> None:
    runs: dict[str, list[dict[str, float]]] = {"default": [], "invariant": []}
    for r in range(rounds):
        for mode in (("default", "invariant") if r % 2 == 0 else ("invariant", "default")):
            runs[mode].append(one_process(mode))
    for key in MEASURES:
        default, invariant = ([run[key] for run in runs[m]] for m in ("default", "invariant"))
        ratio = statistics.median(invariant) / statistics.median(default)
        print(f"{key:6s} default {' '.join(f'{v:.3f}' for v in default)} | invariant "
              f"{' '.join(f'{v:.3f}' for v in invariant)} | invariant / default of the medians {ratio:.2f}x")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(steps(sys.argv[2] == "invariant")))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
