"""For `../shared/tools/ab-bench REV_A REV_B -- python tools/ab/verl_read_rows.py`: one JSON line, the
seconds `verl_rows.read_rows` takes per micro-batch (best of 5): 64 sequences of 1-8k tokens in verl's
nested layout with prompts, responses and a loss mask. Host work done once per micro-batch on the
training path of the verl integration (no verl needed: the batch is a dict)."""
from __future__ import annotations

import json
import time

import torch

from megatron_rl_patches.integrations.verl import rows as verl_rows


def nested(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(200, 2000, (64,), generator=g).tolist()
    responses = torch.randint(1, 6000, (64,), generator=g).tolist()
    batch = {
        "input_ids": nested([torch.zeros(p + r, dtype=torch.long) for p, r in zip(prompts, responses)]),
        "prompts": nested([torch.zeros(p, dtype=torch.long) for p in prompts]),
        "responses": nested([torch.zeros(r, dtype=torch.long) for r in responses]),
        "loss_mask": nested([(torch.rand(p + r, generator=g) < 0.9).long() for p, r in zip(prompts, responses)]),
    }
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        verl_rows.read_rows(batch)
        best = min(best, time.perf_counter() - start)
    print(json.dumps({"read_rows_ms": round(best * 1e3, 3)}))


if __name__ == "__main__":
    main()
