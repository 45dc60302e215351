"""`bench shared-prefix`: a group's prompt once (shared-prefix packing) against each sample packed
whole, on a megatron-core GPTModel on CPU with Qwen3's proportions (RMSNorm, SwiGLU MLP three times
as wide, query/key norms, grouped-query heads of 64, no biases).

Per case (G samples of one prompt of P tokens, responses of R): the same micro-batch two ways
through the same model, attention and fused log-prob head (the response rows only):
- `unshared`: each sample whole, each attending to itself (a plan that shares nothing: the packed
  path with a per-sample attention core, as Transformer Engine's on a GPU; megatron-core's local core
  on CPU would build a dense [T, T] mask and is left out);
- `shared prefix`: the prompt computed once (`megatron_rl_patches.shared_prefix`'s sharing plan);
  in `--shape multi-turn` every shared run of turns once, beside `shared prefix, one level`
  (`levels=1`: each group's longest common prefix once, then each sample's rest whole).
Each row: the tokens the embedding is handed, the forward-only pass's time (no grad) and the
training step's (forward + backward of a loss on the response log-probs), medians over rounds that
alternate the two rows after a warm-up round, one torch thread: the process's CPU time (`_cpu_ms`,
which other jobs on a shared machine move far less) and the wall time (`_ms`); the bytes autograd
keeps for backward (`activations_MiB`, the activations kept: exact, counted per storage); the ratios to
`unshared` of the same case and round (CPU time); the largest |difference| of the log-probs from
`unshared`'s. A line on stderr as each case ends (a full-size case takes minutes). Beside them, where
`prefix_grouper` is importable, the peer's rows (`shared_prefix_peer`: PrefixGrouper on transformers'
Qwen3 of the same shape, against its own unshared baseline); one "not installed" row per case otherwise."""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs
from __future__ import annotations

import platform
import time
from typing import Any

from megatron_rl_patches.apps.bench.benchmark_run import Bars, run_benchmark
from megatron_rl_patches.apps.bench.measure import SavedBytes
from megatron_rl_patches.apps.bench.progress import CaseLines
from megatron_rl_patches.apps.bench.shared_prefix_peer import peer_of, peer_rows
from megatron_rl_patches.apps.bench.shared_prefix_rows import timed_row

FULL: dict[str, Any] = {"layers": 4, "hidden": 512, "heads": 8, "groups": 4, "vocab": 16384, "rounds": 3,
                        "cases": ((1024, 128, 8), (256, 1024, 8))}
QUICK: dict[str, Any] = {"layers": 2, "hidden": 64, "heads": 4, "groups": 2, "vocab": 256, "rounds": 1,
                         "cases": ((48, 8, 4), (8, 24, 2))}
# `--shape multi-turn`: an agent's 4-turn trace (system prompt, per turn a user message and an assistant
# reply; the trajectory branches 4 ways at turn 2 and each branch 4 ways at turn 3), its final
# trajectories as samples, and the same turns as one sample per turn of one trajectory
MULTI_TURN: dict[str, Any] = {**FULL, "shape": "multi-turn", "rounds": 2, "cases": (), "system": 512,
                              "user": 64, "assistant": 128, "branches": (1, 4, 4, 1)}
MULTI_TURN_QUICK: dict[str, Any] = {**QUICK, "shape": "multi-turn", "cases": (), "system": 24, "user": 4,
                                    "assistant": 6, "branches": (1, 2, 2, 1)}
SHAPES = ("grpo", "multi-turn")
# the packings as the rows, the plots and docs/benchmarks.md name them: the package's sharing plan is
# "shared prefix" (every level a run of leading tokens is shared at); `levels=1` shares each group's
# longest common prefix only
UNSHARED, SHARED, ONE_LEVEL = "unshared", "shared prefix", "shared prefix, one level"
COLUMNS = ("case", "packing", "tokens", "forward_ms", "forward_cpu_ms", "forward_vs_unshared", "train_ms",
           "train_cpu_ms", "train_vs_unshared", "activations_MiB", "activations_vs_unshared", "max_abs_diff", "note")


def cpu_name() -> str:
    """The CPU's model name (lscpu's), for the table's title: a ratio is the CPU's."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def build_model(plan: dict) -> Any:
    """A GPTModel with Qwen3's proportions (the kit's packed-input spec: shared-prefix attention replaces its core)."""
    import torch

    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    config = tiny_gpt_config(num_layers=plan["layers"], hidden_size=plan["hidden"],
                             num_attention_heads=plan["heads"], num_query_groups=plan["groups"],
                             kv_channels=plan["hidden"] // plan["heads"], ffn_hidden_size=3 * plan["hidden"],
                             gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                             normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False,
                             init_method_std=0.02)
    turns = plan.get("system", 0) + len(plan.get("branches", ())) * (plan.get("user", 0) + plan.get("assistant", 0))
    longest = max([p + r for p, r, _ in plan["cases"]] + [turns])
    return build_packed_gpt(vocab_size=plan["vocab"], seq_length=longest, seed=0, config=config)


def micro_batch(prompt: int, response: int, group: int, vocab: int, seed: int = 0) -> Any:
    """G samples of one prompt, packed as a framework packs them: (tokens [1, T], labels, cu_seqlens,
    the response rows [1, T] bool)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (prompt,), generator=gen)
    samples = [torch.cat([shared, torch.randint(0, vocab, (response,), generator=gen)]) for _ in range(group)]
    stream = torch.cat([*samples, torch.zeros(1, dtype=torch.long)])
    cu = torch.arange(0, group + 1, dtype=torch.int32) * (prompt + response)
    rows = torch.zeros(1, stream.numel() - 1, dtype=torch.bool)
    for i in range(group):
        rows[0, i * (prompt + response) + prompt - 1:(i + 1) * (prompt + response) - 1] = True
    return stream[None, :-1].contiguous(), stream[None, 1:].contiguous(), cu, rows


def turns_batch(plan: dict, per_turn: bool, seed: int = 0) -> Any:
    """The multi-turn trace packed as a framework packs it: its final trajectories (`per_turn` False)
    or one sample per turn of its first trajectory; rows: those predicting an assistant's tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(0, plan["vocab"], (n,), generator=gen).tolist()

    trajectories = [(draw(plan["system"]), [False] * plan["system"])]
    samples = []
    for branches in plan["branches"]:
        grown = []
        for tokens, answer in trajectories:
            asked, marks = tokens + draw(plan["user"]), answer + [False] * plan["user"]
            grown += [(asked + draw(plan["assistant"]), marks + [True] * plan["assistant"]) for _ in range(branches)]
        trajectories = grown
        samples.append(trajectories[0])
    samples = samples if per_turn else trajectories
    stream = torch.tensor([t for tokens, _ in samples for t in tokens] + [0])
    predicts = torch.tensor([m for _, marks in samples for m in marks[1:] + [False]])[None]
    cu = torch.tensor([0, *torch.tensor([len(t) for t, _ in samples]).cumsum(0).tolist()], dtype=torch.int32)
    return stream[None, :-1].contiguous(), stream[None, 1:].contiguous(), cu, predicts


def cases_of(plan: dict, shape: str) -> list[tuple[str, Any, tuple[str, ...]]]:
    """(case, micro-batch, routes) per case of the shape."""
    if shape == "multi-turn":
        turns = len(plan["branches"])
        fanout = " x ".join(str(b) for b in plan["branches"] if b > 1)
        return [(f"{turns} turns, {fanout} branches", turns_batch(plan, False), (UNSHARED, ONE_LEVEL, SHARED)),
                (f"{turns} turns, a sample per turn", turns_batch(plan, True), (UNSHARED, ONE_LEVEL, SHARED))]
    return [(f"P={p}, R={r}, G={g}", micro_batch(p, r, g, plan["vocab"]), (UNSHARED, SHARED))
            for p, r, g in plan["cases"]]


def params_of(route: str, tokens: Any, cu: Any) -> Any:
    from megatron_rl_patches.shared_prefix import plan_shared_prefix, shared_prefix_params

    if route == UNSHARED:
        return shared_prefix_params(plan_shared_prefix(tokens, cu, min_shared=tokens.numel() + 1))
    return shared_prefix_params(plan_shared_prefix(tokens, cu, levels=1 if route == ONE_LEVEL else None))


def one_pass(model: Any, batch: Any, params: Any, train: bool) -> tuple[Any, tuple[float, float], int]:
    """(the response rows' log-probs, (wall, CPU) seconds, bytes saved for backward) of one pass."""
    import torch

    from megatron_rl_patches import log_prob_output_processor

    tokens, labels, _, rows = batch
    processor = log_prob_output_processor()
    weights = [p for p in model.parameters()]
    saved = SavedBytes(ignore=weights)
    started, cpu = time.perf_counter(), time.process_time()
    with torch.set_grad_enabled(train), saved:
        out = model(tokens, None, None, labels=labels, packed_seq_params=params, output_processor=processor,
                    output_processor_context={"row_mask": rows})
        log_probs = out["log_probs"][rows]
    if train:
        (-log_probs.mean()).backward()
        model.zero_grad(set_to_none=True)
    return log_probs.detach(), (time.perf_counter() - started, time.process_time() - cpu), saved.bytes if train else 0


def measure(plan: dict) -> list[dict]:
    import torch

    import megatron_rl_patches
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.megatron_cpu import megatron_world

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    megatron_rl_patches.apply(only="gpt_output_processor")  # the output_processor keyword before megatron-core 0.18
    try:
        with megatron_world("cpu"):
            model = prepare_shared_prefix(build_model(plan))
            peer = peer_of(plan)  # PrefixGrouper beside ours where it is importable
            every = list(cases_of(plan, plan.get("shape", "grpo")))
            cases = CaseLines(len(every))
            for case, batch, routes in every:
                params = {route: params_of(route, batch[0], batch[2]) for route in routes}
                times: dict[str, dict[str, list[tuple[float, float]]]] = {r: {"forward": [], "train": []}
                                                                          for r in params}
                saved: dict[str, int] = {}
                log_probs: dict[str, Any] = {}
                for round_index in range(plan["rounds"] + 1):
                    for route in params:
                        values, forward, _ = one_pass(model, batch, params[route], train=False)
                        _, train, saved[route] = one_pass(model, batch, params[route], train=True)
                        log_probs[route] = values
                        if round_index:  # the first round warms up
                            times[route]["forward"].append(forward)
                            times[route]["train"].append(train)
                for route in params:
                    rows.append(timed_row(case, route, params[route].shared_prefix.physical_length, times[route],
                                          times[UNSHARED], saved[route], saved[UNSHARED],
                                          float((log_probs[route] - log_probs[UNSHARED]).abs().max())))
                unshared = next(row for row in rows if row["case"] == case and row["packing"] == UNSHARED)
                ours = rows[-1]
                rows += peer_rows(peer, case, batch)
                cases.ended(f"{case}: the training step {ours['train_vs_unshared']:.2f}x the unshared one's "
                            f"CPU time, {ours['tokens']} tokens for {unshared['tokens']}")
    finally:
        megatron_rl_patches.revert()
        torch.set_num_threads(threads)
    return rows


def described(plan: dict) -> str:
    return (f"shared-prefix packing: GPTModel {plan['layers']} layers x {plan['hidden']} hidden (Qwen3's proportions: "
            f"{plan['heads']} heads of {plan['hidden'] // plan['heads']}, {plan['groups']} key/value groups, SwiGLU "
            f"{3 * plan['hidden']}), vocab {plan['vocab']}, fp32,\n{cpu_name()}, one thread; {plan['rounds']} "
            "interleaved rounds")


BARS = Bars(group="case", series="packing",
            values=("forward_vs_unshared", "train_vs_unshared", "activations_vs_unshared"),
            titles=("forward time / unshared", "training step time / unshared", "activations kept / unshared"))


def run(quick: bool = False, out_dir: str | None = None, shape: str = "grpo") -> list[dict]:
    """Print the table; write shared_prefix.csv / .md / .png (`shape` multi-turn: shared_prefix_multi_turn.*)
    into `out_dir` when given (every shape of `bench shared-prefix`: shared_prefix_shapes.run)."""
    if shape not in SHAPES:
        raise ValueError(f"bench shared-prefix: this module's shapes are {', '.join(SHAPES)}, got {shape!r} "
                         "(shared_prefix_shapes.run takes every shape)")
    if shape == "multi-turn":
        plan = MULTI_TURN_QUICK if quick else MULTI_TURN
        title = (f"{described(plan)}\nmulti-turn: system {plan['system']}, per turn user {plan['user']} + assistant "
                 f"{plan['assistant']}, branches per turn {plan['branches']}")
        return run_benchmark("shared_prefix_multi_turn", lambda: measure(plan), "case", COLUMNS, title, BARS, quick,
                             out_dir)
    plan = QUICK if quick else FULL
    return run_benchmark("shared_prefix", lambda: measure(plan), "case", COLUMNS, described(plan), BARS, quick,
                         out_dir)
