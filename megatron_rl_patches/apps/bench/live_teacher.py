"""`bench self-teacher`: the live self-teacher (`student;context=KEY`, `teachers.SelfTeacher`: the
student's current weights through the host's own pass, `LoopHost(student_pass=...)`: its hidden
states and output layer through the fused head) against a
snapshot teacher of the same model (θ₀: a frozen copy of the student's weights, an in-process
`GptTeacher`), both scoring the same privileged batches through the public teacher step.

Each (round, teacher) runs in a fresh process (`runner.run_cases`, the teachers alternating), with
glibc's mmap threshold fixed so that a freed tensor's pages leave the resident set. In it: the
student (a GPTModel on CPU) and the batch are built, then the memory mark is taken (the kernel's
resident-set high-water mark reset, Linux `clear_refs`), then the teacher is built (the snapshot
copies the student's weights; the live teacher holds none) and the step runs (send + collect),
a warm-up step and `steps` timed ones. Per teacher: `built_MiB`, the resident set's growth from
building the teacher; `peak_MiB`, the high-water mark above the mark over the build and every step
(the resident set: RSS, not tracemalloc and not an allocator's counters); `own_weights_MiB`, the
exact bytes of the parameters the teacher holds apart from the student's (each storage counted
once, those shared with the student not at all); the step's median time, wall and CPU (the
process's, one torch thread: a shared machine's other jobs move it far less); and the largest
|difference| of the two teachers' token log-probs (the same weights; the live teacher's fused head
sums in float32, the snapshot's log-softmax of float32 logits in float64: float32 rounding apart).
Then verl's self-teacher pass's memory rows (`self_teacher_pass`)."""
# lazy imports: import cost: torch and megatron-core load in the case workers
from __future__ import annotations

import statistics
import time
from typing import Any

from megatron_rl_patches.apps.bench import outputs, self_teacher_pass
from megatron_rl_patches.apps.bench.benchmark_run import Bars, run_benchmark
from megatron_rl_patches.apps.bench.measure import MIB, memory_resolved
from megatron_rl_patches.apps.bench.runner import run_cases
from megatron_rl_patches.testing.environ import environment

FULL: dict[str, Any] = {
    "layers": 4, "hidden": 512, "heads": 8, "vocab": 32000, "samples": 2, "prompt": 64, "context": 128,
    "response": 256, "top_k": 16, "steps": 3, "rounds": 3}
QUICK: dict[str, Any] = {
    "layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "samples": 2, "prompt": 8, "context": 6,
    "response": 8, "top_k": 4, "steps": 1, "rounds": 1}
TEACHERS = {"live": "live self-teacher (student;context=hint)", "snapshot": "snapshot teacher (θ₀ copy)"}
COLUMNS = ("teacher", "own_weights_MiB", "built_MiB", "peak_MiB", "step_ms", "spread_ms", "vs_live", "cpu_ms",
           "cpu_vs_live", "max_abs_diff",
           "note")
MMAP_THRESHOLD = str(128 << 10)
CASE = "megatron_rl_patches.apps.bench.live_teacher:one_teacher"


def own_weight_bytes(teacher: Any, student: Any) -> int:
    """Bytes of the parameters `teacher` holds that are not the student's (0 for a teacher with no model)."""
    model = getattr(teacher, "model", None)
    if model is None:
        return 0
    shared = {p.untyped_storage().data_ptr() for p in student.parameters()}
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(size for pointer, size in storages.items() if pointer not in shared)


def one_teacher(probe: Any, teacher: str, plan: dict, device: str = "cpu") -> dict:
    """A runner case: one teacher's build and steps in this (fresh) process."""
    import torch

    import megatron_rl_patches
    from megatron_rl_patches.apps.bench.gpt_teacher import GptTeacher
    from megatron_rl_patches.teachers import LoopHost, TeacherBatch, TeacherStep, build_teachers
    from megatron_rl_patches.testing.megatron_cpu import build_tiny_gpt, megatron_world, tiny_gpt_config
    from megatron_rl_patches.testing.student_hidden import response_hidden

    gen = torch.Generator().manual_seed(0)
    length, vocab = plan["prompt"] + plan["response"], plan["vocab"]
    batch = TeacherBatch([torch.randint(0, vocab, (length,), generator=gen) for _ in range(plan["samples"])],
                         [plan["prompt"]] * plan["samples"])
    contexts = {"hint": [torch.randint(0, vocab, (plan["context"],), generator=gen) for _ in range(len(batch))]}
    with megatron_world("cpu"):
        config = tiny_gpt_config(num_layers=plan["layers"], hidden_size=plan["hidden"],
                                 num_attention_heads=plan["heads"])
        longest = plan["response"] + max(plan["prompt"], plan["context"])
        student = build_tiny_gpt(config, vocab_size=vocab, seq_length=longest, seed=0)
        megatron_rl_patches.apply(only="gpt_output_processor")  # megatron-core < 0.18: its output_processor= hook
        host = LoopHost(vocab, student_pass=lambda b: response_hidden(student, b))
        probe.start()
        if teacher == "live":
            (built,) = build_teachers("student;context=hint", host, top_k=plan["top_k"])
        else:  # θ₀: a frozen copy of the student's weights
            snapshot = build_tiny_gpt(config, vocab_size=vocab, seq_length=longest, seed=None)
            snapshot.load_state_dict(student.state_dict())
            built = GptTeacher(snapshot.requires_grad_(False).eval(), vocab, plan["top_k"], context="hint")
        built_bytes = probe.current()
        step = TeacherStep([built], host)
        seconds, cpu = [], []
        for index in range(plan["steps"] + 1):
            started, cpu_started = time.perf_counter(), time.process_time()
            step.send(batch, contexts=contexts)
            (scores,) = step.collect()
            if index:  # the first step warms up
                seconds.append(time.perf_counter() - started)
                cpu.append(time.process_time() - cpu_started)
        return {"teacher": teacher, "own_weight_bytes": own_weight_bytes(built, student),
                "student_weight_bytes": sum(p.numel() * p.element_size() for p in student.parameters()),
                "built_bytes": built_bytes, "peak_bytes": probe.peak(), "peak_reset": probe.peak_reset,
                "seconds": seconds, "cpu_seconds": cpu, "token_log_probs": torch.cat(scores.token_log_probs).tolist()}


def rows_of(results: list[dict], quick: bool) -> list[dict]:
    failed = [r["error"] for r in results if r.get("error")]
    if failed:
        raise RuntimeError(failed[0])
    by = {name: [r for r in results if r["teacher"] == name] for name in TEACHERS}
    live_steps = [statistics.median(r["seconds"]) for r in by["live"]]
    live_cpu = [statistics.median(r["cpu_seconds"]) for r in by["live"]]
    reference = by["live"][0]["token_log_probs"]
    weights = by["live"][0]["student_weight_bytes"]
    resolved = not quick and memory_resolved(weights, "cpu") and all(r["peak_reset"] for r in results)
    rows = []
    for name, label in TEACHERS.items():
        steps = [statistics.median(r["seconds"]) for r in by[name]]
        cpu = [statistics.median(r["cpu_seconds"]) for r in by[name]]
        rows.append({
            "teacher": label, "student_weights_MiB": weights / MIB,
            "own_weights_MiB": max(r["own_weight_bytes"] for r in by[name]) / MIB,
            "built_MiB": statistics.median(r["built_bytes"] for r in by[name]) / MIB if resolved else None,
            "peak_MiB": statistics.median(r["peak_bytes"] for r in by[name]) / MIB if resolved else None,
            "step_ms": statistics.median(steps) * 1e3,
            "spread_ms": f"{min(steps) * 1e3:.0f}-{max(steps) * 1e3:.0f}",
            "vs_live": statistics.median(s / live for s, live in zip(steps, live_steps)),
            "cpu_ms": statistics.median(cpu) * 1e3,
            "cpu_vs_live": statistics.median(s / live for s, live in zip(cpu, live_cpu)),
            "max_abs_diff": max(abs(a - b) for r in by[name] for a, b in zip(r["token_log_probs"], reference)),
            "note": "" if resolved else "memory not measured (--quick: below RSS resolution; or no peak reset here)",
        })
    return rows


def described(plan: dict) -> str:
    return (f"live self-teacher against a snapshot teacher: {outputs.gpt_words(plan)}; {plan['samples']} samples of "
            f"context {plan['context']} + response {plan['response']} per step,\n{plan['rounds']} rounds of a fresh "
            f"process per teacher, {plan['steps']} timed steps each; memory: resident set")


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    """Print the table; write self_teacher.csv / .md / .png into `out_dir` when given; then verl's
    self-teacher pass's memory rows (`self_teacher_pass`: self_teacher_pass.csv / .md)."""
    plan = QUICK if quick else FULL
    cases = [{"target": CASE, "kwargs": {"teacher": name, "plan": plan}}
             for _ in range(plan["rounds"]) for name in TEACHERS]

    def scored() -> list[dict]:
        with environment({"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}):  # glibc reads it as each process starts
            return rows_of(run_cases(cases, isolate=not quick), quick)  # quick: one worker for both

    bars = Bars(group="teacher", series="model", values=("own_weights_MiB", "peak_MiB", "cpu_vs_live"),
                titles=("teacher's own weights (MiB, exact)", "peak above the mark (MiB, RSS)", "step CPU time / live"),
                shown=lambda row: dict(row, model=f"{plan['layers']} x {plan['hidden']}"))
    rows = run_benchmark("self_teacher", scored, "teacher", COLUMNS, described(plan), bars, quick, out_dir,
                         hide_notes=False)
    self_teacher_pass.run(quick, out_dir)
    return rows
