"""The fused log-prob head's forward + backward at `bench shared-prefix`'s head shape (FULL grpo:
1,024 response rows picked by a row_mask out of 2,048, hidden 512, vocab 16,384, float32, one
thread), CPU seconds, medians; the last line is JSON for the A/B tool, which puts each revision's
package first on PYTHONPATH (name this file by an absolute path: an older revision lacks it):

    ../shared/tools/ab-bench REV HEAD -- .venv/bin/python $PWD/tools/head_step_bench.py [--entropy]

`--entropy`: the entropy too, with a gradient (the bench itself asks for log-probs only)."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_rl_patches import lm_head_log_probs_and_entropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entropy", action="store_true")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the bench
    g = torch.Generator().manual_seed(0)
    rows, hidden_size, vocab = 2048, 512, 16384
    hidden = torch.randn(rows, hidden_size, generator=g).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.05).requires_grad_()
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    picked = torch.zeros(rows, dtype=torch.bool)
    picked[rows // 2:] = True

    def outputs():
        return lm_head_log_probs_and_entropy(hidden, weight, tokens, row_mask=picked, with_entropy=args.entropy)

    def step() -> None:
        log_probs, entropy = outputs()
        loss = -log_probs[picked].mean()
        if entropy is not None:
            loss = loss + 0.01 * entropy[picked].mean()
        loss.backward()
        hidden.grad = weight.grad = None

    def forward() -> None:
        with torch.no_grad():
            outputs()

    def cpu_seconds(fn) -> float:
        started = time.process_time()
        fn()
        return time.process_time() - started

    step()  # warm-up
    train = [cpu_seconds(step) for _ in range(args.runs)]
    no_grad = [cpu_seconds(forward) for _ in range(args.runs)]
    print(json.dumps({"train_s": statistics.median(train), "forward_s": statistics.median(no_grad)}))


if __name__ == "__main__":
    main()
