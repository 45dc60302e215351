"""`bench shared-prefix --shape agentic`: a step whose micro-batch budget cuts a group's long prompt,
three ways on the same GPTModel (Qwen3's proportions, `shared_prefix.build_model`) through
megatron-core's own schedule:
- `packed whole`: each sample whole, micro-batches as slime's first fit packs their lengths;
- `once per micro-batch`: `shared_prefix_micro_batches` and a plan per micro-batch (a group the budget
  cuts computes its prompt again in each part; here each sample alone: P + R fills the budget);
- `once per step`: `shared_prefix_micro_batches(held_cost=0)` and `plan_shared_prefix_step`: the
  prompt computed once in a side pass, held, read by every micro-batch, recomputed once in its last
  reader's backward; a sample past the budget in chunks.
Cases: an agentic group (P = 3,000, R = 200, G = 8 at a budget of 3,200 computed tokens) and one
trajectory as a sample per turn (a system prompt and turns, the last samples past the budget).
Each pass scores the rows predicting each sample's last response tokens (its loss: the log-probs through
the fused head, `log_prob_output_processor`), as the `grpo` shape does.
Per row: the micro-batches, the tokens the model computes in a forward-only pass (the embedding's
ids) and those a training step runs again in backward, the training step's and the forward-only
pass's CPU time (medians over interleaved rounds after a warm-up round, one torch thread) and their
ratios to `packed whole`, the resident set's peak above the model during one training step, each
route's in a fresh process (`runner.run_cases`), against `once per micro-batch`'s, and the log-probs'
largest difference from `packed whole`'s, sample by sample."""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs
from __future__ import annotations

import statistics
import time
from typing import Any

from megatron_rl_patches.apps.bench.benchmark_run import Bars, run_benchmark
from megatron_rl_patches.apps.bench.measure import MIB, MemoryProbe
from megatron_rl_patches.apps.bench.progress import CaseLines
from megatron_rl_patches.apps.bench.runner import run_cases

SHAPES = ("agentic",)
FULL: dict[str, Any] = {"layers": 4, "hidden": 512, "heads": 8, "groups": 4, "vocab": 16384, "rounds": 2,
                        "group": (3000, 200, 8), "turns": (2000, 150, 10), "budget": 3200}
QUICK: dict[str, Any] = {"layers": 2, "hidden": 64, "heads": 4, "groups": 2, "vocab": 256, "rounds": 1,
                         "group": (60, 8, 4), "turns": (30, 6, 6), "budget": 64}
WHOLE, PER_MICRO_BATCH, PER_STEP = "packed whole", "once per micro-batch", "once per step"
COLUMNS = ("case", "packing", "micro_batches", "tokens", "recomputed", "train_cpu_ms", "train_vs_whole",
           "forward_cpu_ms", "forward_vs_whole", "peak_MiB", "peak_vs_per_micro_batch", "max_abs_diff")


def samples_of(plan: dict) -> list[tuple[str, list[list[int]], int]]:
    """(case, samples, the response tokens each sample ends with: the rows scored)."""
    from megatron_rl_patches.apps.bench.shared_prefix_budgets import group_samples, turn_samples

    p, r, g = plan["group"]
    system, turn, turns = plan["turns"]
    return [(f"agentic P={p}, R={r}, G={g}", [[t % plan["vocab"] for t in s] for s in group_samples(p, r, g)], r),
            (f"a sample per turn: {system} + {turns} x {turn}",
             [[t % plan["vocab"] for t in s] for s in turn_samples(system, turn, turns)], turn)]


def packed_micro_batch(samples: list[list[int]], batch: list[int], response: int) -> dict:
    """One micro-batch packed as frameworks pack it: ids [1, T], next-token labels, cu_seqlens, and the
    rows predicting each sample's last `response` tokens (the log-probs a loss reads)."""
    import torch

    chosen = [samples[i] for i in batch]
    ids = torch.tensor([t for s in chosen for t in s])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in chosen]).cumsum(0).tolist()], dtype=torch.int32)
    rows = torch.zeros(1, ids.numel(), dtype=torch.bool)
    for end in cu[1:].tolist():
        rows[0, end - response - 1:end - 1] = True
    return {"tokens": ids[None], "labels": torch.roll(ids, -1)[None], "cu_seqlens": cu, "rows": rows,
            "samples": list(batch)}


def route_params(route: str, samples: list[list[int]], budget: int, response: int) -> list[tuple[dict, Any]]:
    """(micro-batch, its packed_seq_params) per micro-batch of the step, packed as `route` packs it."""
    from megatron_rl_patches.shared_prefix import (
        plan_shared_prefix,
        plan_shared_prefix_step,
        shared_prefix_micro_batches,
        shared_prefix_params,
    )
    from megatron_rl_patches.shared_prefix.micro_batches import physical_micro_batches, sample_ids

    if route == PER_STEP:
        cuts = shared_prefix_micro_batches(samples, budget, held_cost=0.0)
        batches = [packed_micro_batch(samples, cut, response) for cut in cuts]
        step = plan_shared_prefix_step([(b["tokens"], b["cu_seqlens"]) for b in batches], max_tokens=budget)
        return [(b, shared_prefix_params(p)) for b, p in zip(batches, step.plans)]
    values = [sample_ids(s, i) for i, s in enumerate(samples)]
    cuts = physical_micro_batches(values, budget, min_shared=1 if route == PER_MICRO_BATCH else 10 ** 9)
    batches = [packed_micro_batch(samples, cut, response) for cut in cuts]
    longest = max(len(s) for s in samples) + 1
    return [(b, shared_prefix_params(plan_shared_prefix(b["tokens"], b["cu_seqlens"],
                                                        min_shared=1 if route == PER_MICRO_BATCH else longest)))
            for b in batches]


def step_pass(model: Any, micro_batches: list[tuple[dict, Any]], train: bool) -> tuple[Any, float, int]:
    """(log-probs, CPU seconds, ids the embedding was handed) of one pass over the step's micro-batches
    through megatron-core's schedule (forward and backward per micro-batch, or forward only)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl_patches import log_prob_output_processor

    processor = log_prob_output_processor()
    seen = [0]
    hook = model.embedding.register_forward_pre_hook(lambda m, a, k: seen.__setitem__(0, seen[0] + int(
        (k.get("input_ids") if "input_ids" in k else a[0]).numel())), with_kwargs=True)
    kept: list[Any] = []

    def forward_step(iterator: Any, one: Any) -> tuple[Any, Any]:
        batch, params = next(iterator)
        scored = one(batch["tokens"], None, None, labels=batch["labels"], packed_seq_params=params,
                     output_processor=processor, output_processor_context={"row_mask": batch["rows"]})

        def loss(output: Any) -> tuple[Any, dict]:
            log_probs = output["log_probs"][batch["rows"]]
            kept.append(log_probs.detach())
            value = -log_probs.mean()
            return value, {"loss": value.detach()}

        return scored, loss

    started = time.process_time()
    try:
        with torch.set_grad_enabled(train):
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro_batches),
                                        model=[model], num_microbatches=len(micro_batches), seq_length=1,
                                        micro_batch_size=1, forward_only=not train)
    finally:
        hook.remove()
    model.zero_grad(set_to_none=True)
    order = [sample for batch, _ in micro_batches for sample in batch["samples"]]
    by_sample = torch.cat(kept).reshape(len(order), -1)  # each sample's response rows, as its micro-batch held them
    return by_sample[torch.tensor(order).argsort()], time.process_time() - started, seen[0]


def peak_case(probe: Any, *, quick: bool, case: int, route: str) -> dict:
    """One training step of `route` on case `case`, in a fresh process (`runner.run_cases`): the
    resident set's peak above the model and the step's plans, in bytes."""
    import megatron_rl_patches
    from megatron_rl_patches.apps.bench.shared_prefix import build_model
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.megatron_cpu import megatron_world

    plan = QUICK if quick else FULL
    cases = samples_of(plan)
    _, samples, response = cases[case]
    megatron_rl_patches.apply(only="gpt_output_processor")
    with megatron_world("cpu"):
        longest = max(len(s) for _, one, _ in cases for s in one)
        model = prepare_shared_prefix(build_model({**plan, "cases": ((longest, 0, 1),)}))
        return peak_here(model, route_params(route, samples, plan["budget"], response), probe)


def peak_here(model: Any, micro_batches: list[tuple[dict, Any]], probe: Any = None) -> dict:
    """The resident set's peak during one training step of `micro_batches`, in bytes."""
    probe = probe if probe is not None else MemoryProbe("cpu")
    probe.start()
    step_pass(model, micro_batches, train=True)
    return {"peak_bytes": probe.peak()}


def measure(plan: dict) -> list[dict]:
    import torch

    import megatron_rl_patches
    from megatron_rl_patches.apps.bench.shared_prefix import build_model
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.megatron_cpu import megatron_world

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    cases = samples_of(plan)
    lines = CaseLines(len(cases))
    megatron_rl_patches.apply(only="gpt_output_processor")  # the output_processor keyword before megatron-core 0.18
    try:
        with megatron_world("cpu"):
            longest = max(len(s) for _, samples, _ in cases for s in samples)
            model = prepare_shared_prefix(build_model({**plan, "cases": ((longest, 0, 1),)}))
            for case, samples, response in cases:
                routes = {route: route_params(route, samples, plan["budget"], response)
                          for route in (WHOLE, PER_MICRO_BATCH, PER_STEP)}
                times: dict[str, dict[str, list[float]]] = {r: {"train": [], "forward": []} for r in routes}
                out: dict[str, Any] = {}
                for round_index in range(plan["rounds"] + 1):
                    for route, micro_batches in routes.items():
                        if route == PER_STEP:  # a step's plans hold their segments once: made anew each pass
                            micro_batches = route_params(route, samples, plan["budget"], response)
                        log_probs, forward, tokens = step_pass(model, micro_batches, train=False)
                        if route == PER_STEP:
                            micro_batches = route_params(route, samples, plan["budget"], response)
                        _, train, ran = step_pass(model, micro_batches, train=True)
                        out[route] = (log_probs, tokens, ran - tokens, len(micro_batches))
                        if round_index:  # the first round warms up
                            times[route]["forward"].append(forward)
                            times[route]["train"].append(train)
                index = [c for c, _, _ in cases].index(case)
                asked = [{"target": f"{__name__}:peak_case", "kwargs": {"quick": plan is QUICK, "case": index,
                                                                        "route": route}} for route in routes]
                # --quick: in this process (its figures are the allocator's, not the step's: not representative)
                measured = ([peak_here(model, route_params(route, samples, plan["budget"], response))
                             for route in routes] if plan is QUICK else run_cases(asked))
                peaks = {route: int(one.get("peak_bytes", 0)) for route, one in zip(routes, measured)}
                whole = {k: statistics.median(v) for k, v in times[WHOLE].items()}
                for route in routes:
                    log_probs, tokens, recomputed, count = out[route]
                    train, forward = (statistics.median(times[route][k]) for k in ("train", "forward"))
                    rows.append({"case": case, "packing": route, "micro_batches": count, "tokens": tokens,
                                 "recomputed": recomputed, "train_cpu_ms": round(1e3 * train, 1),
                                 "train_vs_whole": round(train / whole["train"], 3),
                                 "forward_cpu_ms": round(1e3 * forward, 1),
                                 "forward_vs_whole": round(forward / whole["forward"], 3),
                                 "peak_MiB": round(peaks[route] / MIB, 1),
                                 "peak_vs_per_micro_batch": round(peaks[route] / max(1, peaks[PER_MICRO_BATCH]), 3),
                                 "max_abs_diff": float((log_probs - out[WHOLE][0]).abs().max())})
                ours = rows[-1]
                lines.ended(f"{case}: once per step {ours['tokens']} tokens, the training step "
                            f"{ours['train_vs_whole']:.2f}x packed whole's CPU time")
    finally:
        megatron_rl_patches.revert()
        torch.set_num_threads(threads)
    return rows


def described(plan: dict) -> str:
    from megatron_rl_patches.apps.bench.shared_prefix import cpu_name

    return (f"a step past the micro-batch budget ({plan['budget']} computed tokens): GPTModel {plan['layers']} layers "
            f"x {plan['hidden']} (Qwen3's proportions), vocab {plan['vocab']}, fp32, megatron-core's schedule,\n"
            f"{cpu_name()}, one thread; {plan['rounds']} interleaved rounds")


BARS = Bars(group="case", series="packing", values=("train_vs_whole", "forward_vs_whole", "peak_vs_per_micro_batch"),
            titles=("training step CPU time / packed whole", "forward-only CPU time / packed whole",
                    "peak memory / once per micro-batch"))


def run(quick: bool = False, out_dir: str | None = None, shape: str = "agentic") -> list[dict]:
    """Print the table; write shared_prefix_agentic.csv / .md / .png into `out_dir` when given."""
    if shape not in SHAPES:
        raise ValueError(f"bench shared-prefix: this module's shape is agentic, got {shape!r}")
    plan = QUICK if quick else FULL
    return run_benchmark("shared_prefix_agentic", lambda: measure(plan), "case", COLUMNS, described(plan), BARS,
                         quick, out_dir)
