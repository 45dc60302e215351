"""Memory and time of slime's own step, unpatched (slime's logits path) against `slime_fused`:
slime 624b824a's real `forward_only(get_log_probs_and_entropy)` and `train()` on the lane's tiny
packed GPT, one micro-batch of T packed tokens, vocabulary V (`tools/slime-bench`).

Each (round, route) runs in a fresh process (the package's bench worker); rounds interleave the
routes. Memory is the package's bench method (apps/bench/measure.MemoryProbe: the resident set on
CPU, glibc told to return large blocks at once), in U = 4·T·V bytes (one fp32 [T, V] logits):
`held` is what is alive when the backward of the step's micro-batch starts, `peak` the high-water
mark over a whole train step (forward, backward, optimizer) or a whole forward_only. Train steps
go through slime's own `train()` loop, several steps in one call: each step's gradients are
finalized before the next (calling `train_one_step` on its own leaves the overlapped grad reduce
outstanding, and the next step asserts "Should not have multiple communication calls outstanding").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any
from unittest import mock

from megatron_rl_patches.apps.bench import measure, outputs, runner

HERE = os.path.dirname(os.path.abspath(__file__))
FUSED = ["slime_fused", "gpt_output_processor", "mtp_output_processor"]
# "mtp": one rank, slime's MTP training (one MTP head) on slime's patched GPT model (the lane's copies)
MTP_ARGV = ("--mtp-num-layers", "1", "--enable-mtp-training")
ROUTES = ("unpatched", "slime_fused")
COLUMNS = ("route", "forward_only_s", "train_step_s", "held_U", "peak_U", "forward_only_peak_U",
           "forward_only_vs_unpatched", "train_step_vs_unpatched")


def _model_argv(T: int, V: int, hidden: int, layers: int, heads: int) -> tuple[str, ...]:
    return ("--seq-length", str(T), "--max-position-embeddings", str(T), "--vocab-size", str(V), "--hidden-size",
            str(hidden), "--num-layers", str(layers), "--num-attention-heads", str(heads))


def _replicated(data: dict, steps: int, samples: int) -> dict:
    """`steps` copies of a one-step rollout, one micro-batch of `samples` per step."""
    out = {key: list(value) * steps for key, value in data.items() if key != "micro_batch_indices"}
    out["micro_batch_indices"] = [[step * samples + i for i in range(samples)] for step in range(steps)]
    return out


# per-layout rows: a 2-rank world; the row reports the last pipeline stage (PP) or the rank with the
# highest peak (CP: each rank holds its zigzag rows)
LAYOUTS = {"pp2": {"pipeline": 2}, "cp2": {"context": 2}}


def _layout_argv(layout: str) -> tuple[str, ...]:
    sizes = LAYOUTS.get(layout, {})
    return ("--pipeline-model-parallel-size", str(sizes.get("pipeline", 1)), "--context-parallel-size",
            str(sizes.get("context", 1)))


def step_case(probe: measure.MemoryProbe, *, route: str, T: int, V: int, hidden: int, layers: int, heads: int,
              samples: int, prompt: int, steps: int, device: str = "cpu", layout: str = "1") -> dict:
    """One route in this (fresh) process: `steps` forward_only calls, then slime's train() over
    `steps` steps; times of every call after the first, memory of the last. `layout` "mtp": slime's
    MTP training on its patched GPT model."""
    sys.path.insert(0, HERE)
    if layout == "mtp":
        import slime_megatron_patch

        slime_megatron_patch.install()
    import slime_standins

    slime_standins.install()
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu():
        slime_standins.cpu_accelerator()
        return _measured(probe, route=route, T=T, V=V, hidden=hidden, layers=layers, heads=heads, samples=samples,
                         prompt=prompt, steps=steps, device=device, layout=layout)


def layout_case(rank: int, world_size: int, layout: str, kwargs: dict) -> dict:
    """One route on this rank of a 2-rank world at `layout` (run_multirank spawns each rank)."""
    sys.path.insert(0, HERE)
    import slime_ranks
    from megatron.core import parallel_state

    with slime_ranks.lane_rank(rank, world_size, **LAYOUTS[layout]):
        result = _measured(measure.MemoryProbe(), layout=layout, **kwargs)
        result["last_stage"] = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        return result


def _measured(probe: measure.MemoryProbe, *, route: str, T: int, V: int, hidden: int, layers: int, heads: int,
              samples: int, prompt: int, steps: int, device: str = "cpu", layout: str = "1") -> dict:
    import slime_kit as kit
    from megatron.core.pipeline_parallel import schedules
    from slime.backends.megatron_utils import model as slime_model
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

    import megatron_rl_patches

    if route == "slime_fused":
        megatron_rl_patches.apply(only=FUSED)
    extra = MTP_ARGV if layout == "mtp" else ()
    with kit.slime_session(*_model_argv(T, V, hidden, layers, heads), *_layout_argv(layout), *extra) as args:
        model, optimizer, scheduler = kit.build(args)
        response = T // samples - prompt
        data = kit.rollout(0, prompts=(prompt,) * samples, responses=(response,) * samples, vocab=V,
                           micro_batches=(tuple(range(samples)),))
        forward_times = []
        for call in range(steps):
            if call == steps - 1:
                probe.start()
            start = time.perf_counter()
            out = kit.log_probs(args, model, data)
            forward_times.append(time.perf_counter() - start)
        forward_peak = probe.peak()
        lengths = zip(data["total_lengths"], data["response_lengths"])  # CP: the rank's rows, as slime's actor
        data["advantages"] = [slice_log_prob_with_cp(a, *n) for a, n in zip(data["advantages"], lengths)]
        old = out.get("log_probs") or [a * 0 for a in data["advantages"]]  # a stage before the last: unread
        step_data = _replicated({**data, "log_probs": old}, steps, samples)
        record: dict[str, list] = {"times": [], "held": [], "peak": []}
        train_one_step, backward_step = slime_model.train_one_step, schedules.backward_step

        def measured_step(*a: Any, **k: Any) -> Any:
            probe.start()
            start = time.perf_counter()
            result = train_one_step(*a, **k)
            record["times"].append(time.perf_counter() - start)
            record["peak"].append(probe.peak())
            return result

        def noted_backward(*a: Any, **k: Any) -> Any:
            record["held"].append(probe.current())
            return backward_step(*a, **k)

        with mock.patch.object(slime_model, "train_one_step", measured_step), \
                mock.patch.object(schedules, "backward_step", noted_backward):
            slime_model.train(0, model, optimizer, scheduler, kit.iterators(step_data), [1] * steps,
                              [samples] * steps)
    megatron_rl_patches.revert()
    return {"forward_only_s": statistics.median(forward_times[1:]), "train_step_s": statistics.median(
        record["times"][1:]), "held_bytes": record["held"][-1], "peak_bytes": record["peak"][-1],
        "forward_only_peak_bytes": forward_peak, "peak_reset": probe.peak_reset, "device": device}


def _layout_round(layout: str, route: str, shape: dict) -> dict:
    """One route in a fresh 2-rank world: the last stage's figures (PP), the rank of the highest
    peak (CP)."""
    from slime_step_bench import layout_case  # by name: the spawned ranks import it

    from megatron_rl_patches.testing.multirank import run_multirank

    ranks = run_multirank(layout_case, 2, layout, dict(route=route, **shape), timeout=900)
    if layout == "pp2":
        return next(rank for rank in ranks if rank["last_stage"])
    return max(ranks, key=lambda rank: rank["peak_bytes"])


_LAYOUT_TITLES = {"pp2": "; PP=2, the last stage's process", "cp2": "; CP=2 zigzag, per rank (the highest)",
                  "mtp": "; MTP training, one MTP head (slime's patched GPT model)"}


def run(*, rounds: int, T: int, V: int, hidden: int, layers: int, heads: int, samples: int, prompt: int, steps: int,
        out_dir: str | None, layout: str = "1") -> list[dict]:
    """`rounds` interleaved rounds of both routes (the order alternates), medians over rounds,
    and each round's fused/unpatched time ratio (their median); `layout` "pp2" / "cp2": 2 ranks."""
    shape = dict(T=T, V=V, hidden=hidden, layers=layers, heads=heads, samples=samples, prompt=prompt, steps=steps)
    results: dict[str, list[dict]] = {route: [] for route in ROUTES}
    saved_threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # workers inherit it: freed [T, V] blocks leave the RSS
    try:
        for index in range(rounds):
            for route in ROUTES if index % 2 == 0 else ROUTES[::-1]:
                if layout not in ("1", "mtp"):
                    result = _layout_round(layout, route, shape)
                    print(f"round {index + 1}/{rounds} {layout} {route}: {result}", flush=True)
                    results[route].append(result)
                    continue
                case = {"target": "slime_step_bench:step_case", "kwargs": dict(route=route, layout=layout, **shape)}
                result = runner.run_cases([case], isolate=True, threads=1)[0]
                if "error" in result:
                    raise RuntimeError(f"slime step bench, {route}: {result['error']}")
                print(f"round {index + 1}/{rounds} {route}: {result}", flush=True)
                results[route].append(result)
    finally:
        if saved_threshold is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved_threshold
    unit = 4 * T * V
    rows = []
    for route in ROUTES:
        runs = results[route]
        row: dict[str, Any] = {"route": route, "layout": layout, **shape, "U_bytes": unit, "rounds": rounds}
        for key in ("forward_only_s", "train_step_s"):
            row[key] = statistics.median(r[key] for r in runs)
            row[f"{key[:-2]}_vs_unpatched"] = statistics.median(
                r[key] / base[key] for r, base in zip(runs, results["unpatched"]))
        for key in ("held", "peak", "forward_only_peak"):
            row[f"{key}_bytes"] = statistics.median(r[f"{key}_bytes"] for r in runs)
            row[f"{key}_U"] = row[f"{key}_bytes"] / unit
        row["peak_reset"] = all(r["peak_reset"] for r in runs)
        rows.append(row)
    title = (f"slime 624b824a step, T={T} (packed: {samples} x {T // samples}, prompts {prompt}), V={V}, "
             f"hidden {hidden}, {layers} layer(s), {heads} head(s); CPU 1 thread, fp32; medians of {rounds} "
             f"interleaved rounds (U = 4·T·V bytes)" + _LAYOUT_TITLES.get(layout, ""))
    outputs.print_table(rows, COLUMNS, title=title)
    if out_dir:
        outputs.write_tables(rows, COLUMNS, out_dir, "slime_step" + ("" if layout == "1" else f"_{layout}"),
                            title=title)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096, help="T: packed tokens of the step's micro-batch")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--samples", type=int, default=4, help="samples packed into the micro-batch")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens of each sample")
    parser.add_argument("--steps", type=int, default=3, help="calls per process (the first is not timed)")
    parser.add_argument("--out", default=None, help="folder for slime_step.csv and slime_step.md")
    parser.add_argument("--layout", default="1", choices=("1", *LAYOUTS, "mtp"),
                        help="1: one rank; pp2 / cp2: a 2-rank world; mtp: one rank with slime's MTP training")
    opts = parser.parse_args(argv)
    if opts.steps < 2 or opts.rounds < 1 or opts.tokens % opts.samples or opts.tokens // opts.samples <= opts.prompt:
        parser.error("--steps >= 2, --rounds >= 1, --tokens a multiple of --samples, each sample longer than --prompt")
    if opts.layout == "pp2" and opts.layers % 2:
        parser.error("--layout pp2 splits the layers over 2 stages: give an even --layers")
    run(rounds=opts.rounds, T=opts.tokens, V=opts.vocab, hidden=opts.hidden, layers=opts.layers, heads=opts.heads,
        samples=opts.samples, prompt=opts.prompt, steps=opts.steps, out_dir=opts.out, layout=opts.layout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
