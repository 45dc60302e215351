"""Tokens a step computes at slime's published micro-batch budgets, from the planner alone (no model):
each sample packed whole, a group's prompt once per micro-batch (`shared_prefix_micro_batches` and a
`plan_shared_prefix` per micro-batch, a sample longer than the budget alone as slime's first fit places
it), and once per step (`shared_prefix_micro_batches(held_cost=...)` and `plan_shared_prefix_step`:
a segment the budget cuts held, a long sample in chunks). The samples' trie is the floor: every
distinct leading-token sequence once."""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs
from __future__ import annotations

from dataclasses import dataclass

import torch

# (shape, prompt, response, group size, slime's budget); the last one scaled for CPU
SHAPES = (
    ("math GRPO, P = 300, R = 4k, G = 8", 300, 4096, 8, 9216),
    ("P = 2k, R = 8k, G = 8", 2048, 8192, 8, 20480),
    ("agentic, P = 12k, R = 1k, G = 8", 12288, 1024, 8, 16384),
    ("agentic, P = 30k, R = 2k, G = 8", 30720, 2048, 8, 32768),
    ("scaled for CPU: P = 3,000, R = 200, G = 8", 3000, 200, 8, 3200),
)
TURNS = ("one sample per turn: 4k system + 20 turns of 1.5k", 4096, 1536, 20, 32768)
HELD_COST = 0.0  # the held state against the budget: counted here as none (tokens computed are the figure)


@dataclass(frozen=True)
class BudgetRow:
    shape: str
    budget: int
    packed: int  # tokens, each sample whole
    per_micro_batch: int  # computed, a group's prompt once per micro-batch
    per_step: int  # computed, each segment once per step (padding included)
    recomputed: int  # held segments run again in training's backward
    trie: int  # the floor: each distinct leading-token sequence once
    micro_batches: tuple[int, int]  # per micro-batch, per step

    def as_dict(self) -> dict:
        return {"shape": self.shape, "budget": self.budget, "packed": self.packed,
                "per_micro_batch": self.per_micro_batch, "per_step": self.per_step, "recomputed": self.recomputed,
                "trie": self.trie, "per_micro_batch_ratio": round(self.per_micro_batch / self.packed, 3),
                "per_step_ratio": round(self.per_step / self.packed, 3),
                "micro_batches": list(self.micro_batches)}


def group_samples(prompt: int, response: int, group: int, seed: int = 0) -> list[list[int]]:
    """A group's samples: one prompt, `group` responses of their own."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 50000, (prompt,), generator=gen).tolist()
    return [shared + torch.randint(0, 50000, (response,), generator=gen).tolist() for _ in range(group)]


def turn_samples(system: int, turn: int, turns: int, seed: int = 0) -> list[list[int]]:
    """One trajectory as a sample per turn: each the one before with a turn more."""
    gen = torch.Generator().manual_seed(seed)
    trajectory = torch.randint(0, 50000, (system,), generator=gen).tolist()
    samples = []
    for _ in range(turns):
        trajectory = trajectory + torch.randint(0, 50000, (turn,), generator=gen).tolist()
        samples.append(list(trajectory))
    return samples


def trie_size(samples: list[list[int]]) -> int:
    """Distinct leading-token sequences of `samples` (each sample against the longest common prefix it
    shares with any other, in sorted order)."""
    ordered = sorted(samples)
    total, before = 0, list[int]()
    for sample in ordered:
        common = 0
        for a, b in zip(before, sample):
            if a != b:
                break
            common += 1
        total += len(sample) - common
        before = sample
    return total


def packed(samples: list[list[int]], batch: list[int]) -> tuple[torch.Tensor, list[int]]:
    chosen = [samples[i] for i in batch]
    bounds = [0]
    for sample in chosen:
        bounds.append(bounds[-1] + len(sample))
    return torch.tensor([t for s in chosen for t in s], dtype=torch.int64), bounds


def budget_row(shape: str, samples: list[list[int]], budget: int) -> BudgetRow:
    from megatron_rl_patches.shared_prefix import plan_shared_prefix, plan_shared_prefix_step
    from megatron_rl_patches.shared_prefix.micro_batches import physical_micro_batches, sample_ids

    values = [sample_ids(s, i) for i, s in enumerate(samples)]
    each = physical_micro_batches(values, budget)  # a sample past the budget alone, as slime's first fit
    per_micro_batch = sum(plan_shared_prefix(*packed(samples, batch)).stats.physical_tokens for batch in each)
    from megatron_rl_patches.shared_prefix import shared_prefix_micro_batches

    together = shared_prefix_micro_batches(samples, budget, held_cost=HELD_COST)
    step = plan_shared_prefix_step([packed(samples, batch) for batch in together], max_tokens=budget)
    padding = sum(plan.padding_rows for plan in step.plans)
    return BudgetRow(shape=shape, budget=budget, packed=sum(len(s) for s in samples), per_micro_batch=per_micro_batch,
                     per_step=step.stats.computed_tokens + padding, recomputed=step.stats.recomputed_tokens,
                     trie=trie_size(samples), micro_batches=(len(each), len(together)))


def budget_rows() -> list[BudgetRow]:
    rows = [budget_row(shape, group_samples(p, r, g), budget) for shape, p, r, g, budget in SHAPES]
    shape, system, turn, turns, budget = TURNS
    rows.insert(4, budget_row(shape, turn_samples(system, turn, turns), budget))
    return rows


def budget_table(rows: list[BudgetRow]) -> str:
    """A markdown table of `rows` (tokens computed per step against each sample packed whole)."""
    lines = ["| shape (slime's budget) | packed whole | once per micro-batch | once per step | the samples' trie |"
             " micro-batches |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.shape} ({row.budget:,}) | {row.packed:,} | {row.per_micro_batch / row.packed:.3f} | "
                     f"{row.per_step / row.packed:.3f} | {row.trie / row.packed:.3f} | "
                     f"{row.micro_batches[0]} → {row.micro_batches[1]} |")
    return "\n".join(lines)
