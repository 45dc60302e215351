"""`bench context`: the teacher pass with a privileged context against without, for an in-process
teacher (a frozen GPTModel on CPU, `apps.bench.gpt_teacher.GptTeacher`) through the public teacher
step (`TeacherStep.send(batch, contexts=...)`, then `collect()`).

Cases: the student's batch as it is (no context: each sample's prompt then its response); a
context equal to each sample's own prompt (a control: the same sequences, so the same scores bit
for bit and only the splice added); contexts of several lengths (random ids) in place of the
prompt. Per case: the tokens the teacher's forward runs (context + response per sample), the
response rows scored (the same in every case), the step's time (send + collect; the cases
interleaved, one step each per round after a warm-up round: median and min-max spread, and
`vs_without` = the median over rounds of the time over the no-context step's in the same round;
the same for the process's CPU time, one torch thread: `cpu_ms`, `cpu_vs_without`, which a shared
machine's other jobs move far less than the wall time),
the time of building the teacher's batch alone (`with_context`, median) and the largest |difference|
of the scores from the no-context case's (0 for the control)."""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs
from __future__ import annotations

import statistics
import time
from typing import Any

from megatron_rl_patches.apps.bench import outputs
from megatron_rl_patches.apps.bench.benchmark_run import Bars, run_benchmark

FULL: dict[str, Any] = {
    "layers": 4, "hidden": 256, "heads": 8, "vocab": 8192, "samples": 8, "prompt": 128, "response": 256,
    "contexts": (32, 512, 1024), "top_k": 16, "rounds": 5}
QUICK: dict[str, Any] = {
    "layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "samples": 2, "prompt": 8, "response": 8,
    "contexts": (4, 16), "top_k": 4, "rounds": 1}
WITHOUT, CONTROL = "no context", "context = the sample's own prompt"
COLUMNS = ("case", "context_tokens", "teacher_tokens", "response_rows", "tokens_vs_without", "step_ms", "spread_ms",
           "vs_without", "cpu_ms", "cpu_vs_without", "splice_ms", "max_abs_diff", "note")


def label(length: int) -> str:
    return f"context of {length} tokens"


def student_batch(plan: dict) -> Any:
    import torch

    from megatron_rl_patches.teachers import TeacherBatch

    gen = torch.Generator().manual_seed(0)
    length = plan["prompt"] + plan["response"]
    return TeacherBatch([torch.randint(0, plan["vocab"], (length,), generator=gen) for _ in range(plan["samples"])],
                        [plan["prompt"]] * plan["samples"])


def case_contexts(plan: dict, batch: Any) -> dict[str, Any]:
    """Each case's contexts (None: no context)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    cases: dict[str, Any] = {WITHOUT: None, CONTROL: [s[:plan["prompt"]].clone() for s in batch.sequences]}
    for length in plan["contexts"]:
        cases[label(length)] = [torch.randint(0, plan["vocab"], (length,), generator=gen)
                                for _ in range(plan["samples"])]
    return cases


def max_diff(scores: Any, reference: Any) -> float:
    return max(float((a - b).abs().max()) for part in ("token_log_probs", "topk_log_probs", "tail_log_probs")
               for a, b in zip(getattr(scores, part), getattr(reference, part)))


def measure(plan: dict) -> list[dict]:
    """One row per case, the cases interleaved one step each per round after a warm-up round."""
    import torch

    from megatron_rl_patches.apps.bench.gpt_teacher import GptTeacher
    from megatron_rl_patches.teachers import TeacherStep, local_host, with_context
    from megatron_rl_patches.testing.megatron_cpu import build_tiny_gpt, megatron_world, tiny_gpt_config

    batch = student_batch(plan)
    cases = case_contexts(plan, batch)
    longest = plan["response"] + max(plan["prompt"], *plan["contexts"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, as every benchmark case: its CPU time is the step's work
    with megatron_world("cpu"):
        config = tiny_gpt_config(num_layers=plan["layers"], hidden_size=plan["hidden"],
                                 num_attention_heads=plan["heads"])
        model = build_tiny_gpt(config, vocab_size=plan["vocab"], seq_length=longest, seed=0).eval()
        host = local_host(plan["vocab"])
        steps = {case: TeacherStep([GptTeacher(model, plan["vocab"], plan["top_k"],
                                               None if contexts is None else "hint")], host)
                 for case, contexts in cases.items()}
        seconds: dict[str, list[float]] = {case: [] for case in cases}
        cpu: dict[str, list[float]] = {case: [] for case in cases}
        splice: dict[str, list[float]] = {case: [] for case in cases}
        scores: dict[str, Any] = {}
        for round_index in range(plan["rounds"] + 1):
            for case, contexts in cases.items():
                started, cpu_started = time.perf_counter(), time.process_time()
                steps[case].send(batch, contexts=None if contexts is None else {"hint": contexts})
                (scores[case],) = steps[case].collect()
                took, cpu_took = time.perf_counter() - started, time.process_time() - cpu_started
                if contexts is not None:
                    started = time.perf_counter()
                    with_context(batch, contexts, vocab_size=plan["vocab"])
                    splice[case].append(time.perf_counter() - started)
                if round_index:  # the first round warms up
                    seconds[case].append(took)
                    cpu[case].append(cpu_took)
    torch.set_num_threads(threads)
    rows = []
    plain, plain_cpu = seconds[WITHOUT], cpu[WITHOUT]
    for case, contexts in cases.items():
        context = 0 if contexts is None else len(contexts[0])
        tokens = plan["samples"] * ((context or plan["prompt"]) + plan["response"])
        rows.append({
            "case": case, "context_tokens": context, "teacher_tokens": tokens,
            "response_rows": sum(len(r) for r in scores[case].token_log_probs),
            "tokens_vs_without": tokens / (plan["samples"] * (plan["prompt"] + plan["response"])),
            "step_ms": statistics.median(seconds[case]) * 1e3,
            "spread_ms": f"{min(seconds[case]) * 1e3:.0f}-{max(seconds[case]) * 1e3:.0f}",
            "vs_without": statistics.median(s / p for s, p in zip(seconds[case], plain)),
            "cpu_ms": statistics.median(cpu[case]) * 1e3,
            "cpu_vs_without": statistics.median(s / p for s, p in zip(cpu[case], plain_cpu)),
            "splice_ms": statistics.median(splice[case]) * 1e3 if splice[case] else 0.0,
            "max_abs_diff": max_diff(scores[case], scores[WITHOUT]) if case in (WITHOUT, CONTROL) else None,
            "note": "",
        })
    return rows


def described(plan: dict) -> str:
    return (f"teacher pass with a privileged context: {outputs.gpt_words(plan)}; {plan['samples']} samples of prompt "
            f"{plan['prompt']} + response {plan['response']}, TeacherStep send + collect,\n{plan['rounds']} "
            "interleaved rounds")


BARS = Bars(group="case", series="teacher", values=("tokens_vs_without", "cpu_vs_without"),
            titles=("teacher forward tokens / no context", "step CPU time / no context"),
            shown=lambda row: dict(row, teacher="in-process GPTModel"))


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    """Print the table; write context_pass.csv / .md / .png into `out_dir` when given."""
    plan = QUICK if quick else FULL
    return run_benchmark("context_pass", lambda: measure(plan), "case", COLUMNS,
                         described(plan), BARS, quick, out_dir)
