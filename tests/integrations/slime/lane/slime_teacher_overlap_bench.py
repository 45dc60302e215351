"""A served teacher on slime's critical path, measured (issue 88 items 1 and 5; `tools/teacher-overlap-bench`,
docs/benchmarks.md "A served teacher off the train step"): slime 624b824a's real rollout
(`slime_rollout_scores.py` in its own interpreter: `generate_and_rm_group`, its sample hooks, the
rollout manager's split; SGLang's `/generate` answered with ids sampled by a real vLLM CPU server
of the student's shape: the rollout engine's stand-in) and its real `train_actor` (one rank,
`slime_ranks.opd_train_actor`) with a served teacher on the top-k route (a second vLLM CPU server,
MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher, a snapshot teacher beside it), for two teachers: as fast
as the student's own pass over the step's samples, and about 4x slower (a wider, deeper model of
the same tokenizer; the measured ratio is in the rows).

Per teacher and route (MEGATRON_RL_PATCHES_OPD_SCORE_AT=train, the teacher asked by the train
step; =rollout, each sample asked as its generation ends), `rounds` rollouts then as many
`train_actor` steps (the first step of each world a warm-up, left out): the rollout's seconds, the
step's, the seconds the step waited in `collect()` for the teacher (`TeacherStep.metrics()`) and
their share of the step, rollout + train against the train-step route's, and the carried rows'
bytes per response token (against a head route's 2H). Every figure is a ratio or a share on this
machine: its 2 cores run the servers and the trainer at once, so a teacher's time here also
competes with the student's for the same cores, unless kept apart: here the job's devices (the
rollout engine and the trainer: a colocated slime job's GPUs, time-shared between rollout and
training) are core 0, one thread each, and the teacher's server core 1 (its own GPUs), each
pinned (`taskset`, `sched_setaffinity`); slime's rollout manager (a CPU process: the HTTP clients,
the hooks) runs beside the teacher on core 1, as it runs on a host's CPU beside the GPUs. The
machine is shared with other jobs: the rows are medians of interleaved steps, ratios only.

    tools/teacher-overlap-bench PYTHON LANE --vllm-python VLLM_PYTHON [--quick] [--out docs/bench]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 64
STUDENT = {"hidden": 128, "layers": 4, "heads": 4}  # the trained model (slime's flags)
# the engine's model: the student's shape; the teachers: as fast as the student, and ~4x slower (FLOPs ~ H^2 L)
ENGINE = dict(hidden_size=128, head_dim=32, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2)
TEACHERS = {"as fast as the student": ENGINE,
            "~4x slower": dict(hidden_size=512, head_dim=64, intermediate_size=1536, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=2)}
# 4 samples: slime_ranks' rollouts hold 4 rewards
FULL = {"samples": 4, "prompt": 64, "response": 192, "rounds": 4, "repeats": 2}
QUICK = {"samples": 4, "prompt": 6, "response": 5, "rounds": 2, "repeats": 1}
ROUTES = ("train", "rollout")
COLUMNS = ("teacher", "route", "rollout_s", "train_step_s", "collect_wait_s", "wait_share", "total_s",
           "total_vs_train_route", "teacher_vs_student", "row_bytes_per_token")


def write_model(directory: Path, shape: dict, seed: int) -> str:
    from megatron_rl_patches.testing.hf_checkpoints import (
        save_word_tokenizer,
        tiny_hf_config,
        transformers_layout,
        write_tiny_checkpoint,
    )

    config = {**transformers_layout(tiny_hf_config("qwen3", vocab_size=VOCAB, max_position_embeddings=512,
                                                   **shape)), "architectures": ["Qwen3ForCausalLM"]}
    write_tiny_checkpoint(directory, config, seed=seed)
    save_word_tokenizer(directory, VOCAB)
    return str(directory)


JOB_CORE, TEACHER_CORE = 0, 1


def pinned_python(python: str, core: int, folder: Path) -> str:
    """An interpreter pinned to one core (a wrapper script: vLLM's server is started by its path)."""
    path = folder / f"python-core{core}"
    path.write_text(f'#!/bin/sh\nexec taskset -c {core} "{python}" "$@"\n')
    path.chmod(0o755)
    return str(path)


def entries(url: str) -> str:
    return f"{url};engine=vllm,teacher-a"


def rollouts(tmp: Path, engine: str, student_dir: str, teacher: str, route: str, plan: dict) -> list[dict]:
    """`plan["rounds"]` rollouts of slime's in a row, in a fresh interpreter (its rollout manager's
    process, long-lived: the teacher connected once), the responses ending at different lengths."""
    from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS

    path = tmp / f"rollout-{route}.pt"
    config = {"engine": engine, "model": student_dir, "prompts": [plan["prompt"]] * plan["samples"],
              "response": plan["response"], "spread": True, "seed": 0, "rounds": plan["rounds"] + 1,
              "out": str(path)}
    (tmp / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "MEGATRON_RL_PATCHES_OPD_TEACHERS": entries(teacher), "MEGATRON_RL_PATCHES_OPD_K": "4",
           "MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teacher", "MEGATRON_RL_PATCHES_OPD_SCORE_AT": route}
    env.pop("MEGATRON_RL_PATCHES", None)
    done = subprocess.run(["taskset", "-c", str(TEACHER_CORE), sys.executable, "-W", "ignore",
                           os.path.join(HERE, "slime_rollout_scores.py"), str(tmp / "config.json")],
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1800, cwd=HERE)
    if done.returncode:
        raise RuntimeError(f"slime's rollout failed: {done.stderr[-3000:]}")
    out = []
    for seed, saved in enumerate(torch.load(path, weights_only=False)["rounds"]):
        rank = saved["rank"]
        gen = torch.Generator().manual_seed(seed)
        data = {"tokens": list(rank["tokens"]), "total_lengths": [len(t) for t in rank["tokens"]],
                "response_lengths": [int(r) for r in rank["response_lengths"]],
                "loss_masks": [torch.as_tensor(m, dtype=torch.int) for m in rank["loss_masks"]],
                "advantages": [torch.randn(int(r), generator=gen) for r in rank["response_lengths"]],
                "micro_batch_indices": [list(range(i, i + 2)) for i in range(0, len(rank["tokens"]), 2)]}
        if CONTEXTS in rank:
            data[CONTEXTS] = rank[CONTEXTS]
        out.append({"data": data, "rollout_s": saved["rollout_s"], "logged": saved["logged"]})
    return out


def train_rank(rank: int, world_size: int, served: dict, rounds: int, flags: tuple[str, ...]) -> dict:
    """One rank of the training world: slime's train_actor over the rollouts, the student's own
    top-k pass timed (its first pass of each step: the window a train-step teacher overlaps)."""
    os.sched_setaffinity(0, {JOB_CORE})  # the job's core, one thread (the teacher's server has the other)
    torch.set_num_threads(1)
    import slime_ranks

    from megatron_rl_patches.integrations.slime import opd

    passes: list[float] = []
    real = opd.topk_pass

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            passes.append(time.perf_counter() - started)

    opd.topk_pass = timed
    try:
        out = slime_ranks.opd_train_actor(rank, world_size, 1, 1, 1, None, None, flags, rounds, None, 1, None, None,
                                          served)
    finally:
        opd.topk_pass = real
    return {"step_seconds": out["step_seconds"], "figures": out["figures_per_step"], "passes": passes}


def teacher_alone(url: str, data: dict, repeats: int = 3) -> float:
    """The served teacher's seconds for one step's samples, asked alone (the median of `repeats`)."""
    from megatron_rl_patches.integrations.megatron.opd.stage_host import batch_of
    from megatron_rl_patches.teachers import ServedTeacher

    with ServedTeacher(url, "vllm", top_k=4) as teacher:
        teacher.check()
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            teacher.score(batch_of(data))
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def student_flags(plan: dict) -> tuple[str, ...]:
    longest = plan["prompt"] + plan["response"]
    return ("--hidden-size", str(STUDENT["hidden"]), "--num-layers", str(STUDENT["layers"]),
            "--num-attention-heads", str(STUDENT["heads"]), "--seq-length", str(longest),
            "--max-position-embeddings", str(longest))


def one_case(tmp: Path, engine: str, student_dir: str, teacher: str, route: str, plan: dict) -> dict:
    from megatron_rl_patches.integrations.megatron.opd.carried_rows import ROWS
    from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS
    from megatron_rl_patches.testing.multirank import run_multirank

    made = rollouts(tmp, engine, student_dir, teacher, route, plan)
    served = {"entries": entries(teacher), "student": student_dir, "rollouts": [r["data"] for r in made]}
    (rank,) = run_multirank(train_rank, 1, served, len(made), student_flags(plan), timeout=1800)
    carried = [one[ROWS] for r in made for one in r["data"].get(CONTEXTS, []) if ROWS in one]
    row_bytes = sum(t.numel() * t.element_size() for rows in carried for got in rows.values()
                    for t in (got["ids"], got["values"], got["tails"], got["token"]))
    tokens = sum(sum(r["data"]["response_lengths"]) for r in made)
    steps = rank["step_seconds"][1:]  # the world's first step warms up
    waits = [f["collect_wait_s"] for f in rank["figures"][1:]]
    student = statistics.median(rank["passes"][0::2][1:])  # each step's first pass: the student's top-k
    return {"rollout_s": statistics.median(r["rollout_s"] for r in made[1:]),  # the first: the teacher's connect
            "train_step_s": statistics.median(steps), "collect_wait_s": statistics.median(waits),
            "wait_share": statistics.median(w / s for w, s in zip(waits, steps)),
            "student_pass_s": student, "teacher_alone_s": teacher_alone(teacher, made[0]["data"]),
            "row_bytes_per_token": row_bytes / tokens if carried else None,
            "scored_before": [f["scored_before"] for f in rank["figures"]],
            "rollout_logged": made[-1]["logged"]}


def rows_of(results: dict[tuple[str, str], list[dict]]) -> list[dict]:
    """The table: per teacher and route the medians over the repeats (the routes interleaved), the
    total against the train-step route's of the same repeat; the teacher's time alone (every
    measurement of it) against the student's own pass with no teacher in flight (the rollout
    route's)."""
    rows = []
    for (teacher, route), each in results.items():
        base = results[(teacher, "train")]
        alone = results.get((teacher, "rollout"), each)
        numbers = {name: statistics.median(got[name] for got in each) for name in each[0]
                   if isinstance(each[0][name], (int, float)) and not isinstance(each[0][name], bool)}
        totals = [got["rollout_s"] + got["train_step_s"] for got in each]
        rows.append({"teacher": teacher, "route": "teacher at the train step" if route == "train" else
                     "teacher at the rollout", **numbers, "total_s": statistics.median(totals),
                     "total_vs_train_route": statistics.median(
                         total / (b["rollout_s"] + b["train_step_s"]) for total, b in zip(totals, base)),
                     "teacher_vs_student": statistics.median(got["teacher_alone_s"] for both in
                                                             (base, alone) for got in both)
                     / statistics.median(got["student_pass_s"] for got in alone)})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=os.environ.get("MRP_VLLM_PYTHON"), help="vLLM's interpreter")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds: minutes, for a smoke test")
    parser.add_argument("--out", help="write teacher_overlap.csv / .md / .png here (e.g. docs/bench)")
    args = parser.parse_args(argv)
    if not args.vllm_python:
        parser.error("--vllm-python (or MRP_VLLM_PYTHON): vLLM's interpreter, e.g. .lanes/vllm/bin/python")
    from megatron_rl_patches.apps.bench import outputs
    from megatron_rl_patches.testing.vllm_server import vllm_server

    plan = QUICK if args.quick else FULL
    teachers = dict(list(TEACHERS.items())[:1]) if args.quick else TEACHERS
    started = time.perf_counter()
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        tmp = Path(folder)
        student_dir = write_model(tmp / "engine", ENGINE, seed=3)
        engine = stack.enter_context(vllm_server(pinned_python(args.vllm_python, JOB_CORE, tmp), student_dir,
                                                 tmp / "engine.log", max_model_len=512, max_logprobs=20))
        for name, shape in teachers.items():
            index = len(results)
            directory = student_dir if shape is ENGINE else write_model(tmp / f"teacher-{index}", shape, seed=5)
            with vllm_server(pinned_python(args.vllm_python, TEACHER_CORE, tmp), directory,
                             tmp / f"teacher-{index}.log", max_model_len=512, max_logprobs=20) as teacher:
                for repeat in range(plan["repeats"]):  # the routes interleaved: a busy minute hits both
                    for route in ROUTES:
                        print(f"teacher-overlap: {name}, teacher at the {route} ({repeat + 1}/{plan['repeats']})",
                              file=sys.stderr, flush=True)
                        results.setdefault((name, route), []).append(
                            one_case(tmp, engine.url, student_dir, teacher.url, route, plan))
    rows = rows_of(results)
    title = outputs.titled(
        f"a served teacher on slime's critical path: slime's real rollout + train_actor (1 rank, CPU: the engine and "
        f"the trainer on core {JOB_CORE}, the teacher's server and the rollout manager on core {TEACHER_CORE}),\n"
        f"{plan['samples']} samples of {plan['prompt']} + {plan['response']} tokens a step, student "
        f"{STUDENT['layers']} x {STUDENT['hidden']}, top-4 route; medians of {plan['repeats']} interleaved repeats of "
        f"{plan['rounds']} steps "
        f"({time.perf_counter() - started:.0f} s)", args.quick)
    outputs.print_table(rows, COLUMNS, title=title)
    if args.out:
        outputs.write_tables(rows, COLUMNS, args.out, "teacher_overlap", title=title)
        outputs.plot_grouped_bars(rows, os.path.join(args.out, "teacher_overlap.png"), group="teacher",
                                  series="route", values=["wait_share", "total_vs_train_route"],
                                  titles=["train step's wait in collect() / step",
                                          "rollout + train / train-step route"],
                                  suptitle=title)
    return rows


if __name__ == "__main__":
    main()
