"""A group's teacher time on `megatron-rl-patches serve-teacher` against a stock vLLM server (issue 98):

    PYTHONPATH=. .venv/bin/python tools/serve_teacher_bench.py --vllm-python .lanes/vllm/bin/python --out bench-out/st

A random Qwen3 (float32; tiny, or `--hidden 512 --layers 4` for a forward that is a real part of the
time) served on the loopback by both, both up at once and asked in turn: each group is scored by one
server then the other, the order turning from group to group, so a load that drifts over the run
weighs on both alike. Per shape (P prompt ids, R response ids a sample, G samples a group): the
median and the best time per group over `--groups` groups of fresh prompts, scored through
`ServedTeacher` (top-20 with the exact tail; with `--states` hidden states), the teacher tokens each
computed per group (the engine's own `/metrics`), the ratio (the median of each group's
two times' ratio, and the ratio of the bests) and its floor
(P + G·R) / (G·(P + R)). Writes serve_teacher.json and serve_teacher.md (rows for
docs/benchmarks.md), the CPU and its load named.

With `--blocks 32,64,128` serve-teacher alone at each KV block size (`--block-size`), all up at once and
asked in turn, on `--shapes` (P/R/G, e.g. 96/24/8,128/24/8,133/24/8,1024/128/8): per shape and block,
the median of the servers' processes' CPU seconds a group (a load hardly moves them), the median and
best wall seconds and the teacher tokens computed, against the largest block (128: vLLM's CPU
default). Writes serve_teacher_blocks.json and .md.

    PYTHONPATH=. .venv/bin/python tools/serve_teacher_bench.py --vllm-python .lanes/vllm/bin/python \
        --blocks 32,64,128 --shapes 96/24/8,128/24/8,133/24/8,1024/128/8 --out bench-out/st-blocks"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, TeacherBatch
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer
from megatron_rl_patches.testing.vllm_server import launch as launch_server
from megatron_rl_patches.testing.vllm_server import serving

VOCAB = 1001
KEY = "bench-key"
SHAPES = ((1024, 128, 8), (256, 1024, 8))


def model_shape(hidden: int, layers: int) -> dict[str, int]:
    """A random Qwen3 of `hidden` width and `layers` layers. Below a width of 256 the tiny test model's
    heads (4 of 32, 2 key/value) and an MLP 1.5 times as wide (hidden 64: the earlier runs' model);
    from 256 on, Qwen3's proportions: heads of 64, a quarter as many key/value heads, an MLP three
    times as wide. The vocabulary stays tiny (the head is the client's, the same for both servers)."""
    if hidden < 256:
        return dict(hidden_size=hidden, head_dim=32, intermediate_size=3 * hidden // 2, num_hidden_layers=layers,
                    vocab_size=VOCAB)
    if hidden % 64:
        raise ValueError(f"--hidden must be a multiple of 64 from 256 on, got {hidden}")
    heads = hidden // 64
    return dict(hidden_size=hidden, head_dim=64, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                intermediate_size=3 * hidden, num_hidden_layers=layers, vocab_size=VOCAB)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def group(prompt: int, response: int, size: int, seed: int) -> TeacherBatch:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, VOCAB, (prompt,), generator=gen)
    firsts = torch.randperm(VOCAB, generator=gen)[:size]
    return TeacherBatch([torch.cat([shared, firsts[i: i + 1], torch.randint(0, VOCAB, (response - 1,), generator=gen)])
                         for i in range(size)], [prompt] * size)


def computed(url: str) -> float:
    import httpx

    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="local_compute"' in line)


def timed_group(teacher: ServedTeacher, url: str, batch: TeacherBatch) -> tuple[float, float]:
    """(seconds, teacher tokens the engine computed) for one group scored through `teacher`."""
    before = computed(url)
    start = time.perf_counter()
    teacher.score(batch)
    seconds = time.perf_counter() - start
    return seconds, computed(url) - before


def measure(servers: dict[str, str], directory: Path, shape: tuple[int, int, int], groups: int,
            states: bool) -> dict[str, dict[str, Any]]:
    """Per server: each group's seconds (`times`, in the groups' order), their median and best, and
    the median tokens per group. Both servers are up; each group is scored by one then the other (the
    order turning from group to group), so a load that drifts over the run weighs on both alike."""
    prompt, response, size = shape
    head = {"head": str(directory)} if states else {}
    settings = ClientSettings(deadline_s=600)
    with contextlib.ExitStack() as stack:
        teachers = {name: stack.enter_context(ServedTeacher(url, top_k=20, client=settings, **head))
                    for name, url in servers.items()}
        # seeds of their own per shape: one shape's prompt must not be the start of another's (whose cached
        # blocks would hold the row before the response, which the group's first then computes twice)
        first = 1_000 * (prompt + 7 * response)
        for teacher in teachers.values():  # warm: the first request's one-off costs
            teacher.score(group(prompt, response, size, seed=first + groups))
        found: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
        for turn, seed in enumerate(range(first, first + groups)):
            batch = group(prompt, response, size, seed)
            names = list(servers) if turn % 2 == 0 else list(reversed(servers))
            for name in names:
                found[name].append(timed_group(teachers[name], servers[name], batch))
    return {name: {"times": [t for t, _ in pairs], "seconds": statistics.median(t for t, _ in pairs),
                   "best": min(t for t, _ in pairs), "tokens": statistics.median(n for _, n in pairs)}
            for name, pairs in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="vLLM 0.32's interpreter (the served lane's venv)")
    parser.add_argument("--out", default="bench-out/serve-teacher")
    parser.add_argument("--groups", type=int, default=5, help="groups timed per shape and server")
    parser.add_argument("--scale", type=float, default=1.0, help="P and R times this (a reduced run: 0.25)")
    parser.add_argument("--states", action="store_true", help="hidden states (a head) instead of top-k rows")
    parser.add_argument("--hidden", type=int, default=64, help="the model's width (512: a forward that is a real "
                                                               "part of the time; 64: overheads dominate)")
    parser.add_argument("--layers", type=int, default=2, help="the model's layers")
    parser.add_argument("--blocks", default=None, help="serve-teacher alone at these KV block sizes (e.g. 32,64,128)")
    parser.add_argument("--shapes", default=None, help="P/R/G shapes joined by ',' (default: the issue's two)")
    args = parser.parse_args()
    os.environ["MEGATRON_RL_PATCHES_TEACHER_API_KEY"] = KEY
    if args.blocks:
        torch.set_num_threads(1)
        blocks_main(args)
        return
    # the client's own work (reading the replies, the head's top-k with `--states`) on one thread: the
    # servers hold the cores, and a client of two OpenMP threads on a loaded machine spins (a [1024, 64]
    # x [64, 1001] product took 86 ms at load average 20), a cost both servers' times carry alike
    torch.set_num_threads(1)
    shapes = [(max(1, round(p * args.scale)), max(1, round(r * args.scale)), g) for p, r, g in SHAPES]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        directory, longest = teacher_dir(scratch, args, shapes)
        launched = {}
        for name, ours in (("stock vLLM", False), ("serve-teacher", True)):
            extra: tuple[str, ...] = ("--block-size", "32") if ours else ()
            if args.states and not ours:
                extra = ("--runner", "pooling", "--convert", "embed", "--pooler-config", '{"task": "token_embed"}')
            launched[name] = launch_server(args.vllm_python, directory, Path(scratch) / f"{name}.log",
                                           max_model_len=longest, api_key=KEY, extra=extra, serve_teacher=ours)
        with contextlib.ExitStack() as up:
            urls = {name: up.enter_context(serving(server, 900)).url for name, server in launched.items()}
            loads = [load()]
            found = {f"{p}/{r}/{g}": measure(urls, directory, (p, r, g), args.groups, args.states)
                     for p, r, g in shapes}
            loads.append(load())
        for p, r, g in shapes:
            key = f"{p}/{r}/{g}"
            stock, ours_ = found[key]["stock vLLM"], found[key]["serve-teacher"]
            # the ratio of each group's two times (scored one after the other), their median: the figure a load
            # that swings within seconds moves least; the ratio of the two bests beside it
            paired = [o / s for o, s in zip(ours_["times"], stock["times"], strict=True)]
            rows.append({"P": p, "R": r, "G": g, "stock_s": stock["seconds"], "ours_s": ours_["seconds"],
                         "stock_best": stock["best"], "ours_best": ours_["best"],
                         "stock_times": stock["times"], "ours_times": ours_["times"],
                         "ratio": statistics.median(paired), "best_ratio": ours_["best"] / stock["best"],
                         "floor": (p + g * r) / (g * (p + r)),
                         "stock_tokens": stock["tokens"], "ours_tokens": ours_["tokens"]})
    lines = ["| P | R | G | stock vLLM s/group (median / best) | serve-teacher s/group (median / best) "
             "| ratio (median of the groups' / of the bests) | floor | tokens computed (stock / ours) |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['P']} | {r['R']} | {r['G']} | {r['stock_s']:.3f} / {r['stock_best']:.3f} | {r['ours_s']:.3f} / "
              f"{r['ours_best']:.3f} | {r['ratio']:.2f} / {r['best_ratio']:.2f} | {r['floor']:.3f} | "
              f"{r['stock_tokens']:g} / {r['ours_tokens']:g} |" for r in rows]
    written(Path(args.out) / "serve_teacher", args, loads, rows, lines)


def written(stem: Path, args: argparse.Namespace, loads: list[str], rows: list[dict], lines: list[str]) -> None:
    """The rows as `stem`.json and the table as `stem`.md (the CPU, its load, the route and the model
    named under it); both printed."""
    said = {"cpu": f"{cpu_name()}, {os.cpu_count()} cores", "load": f"load average {loads[0]} before, {loads[1]} after",
            "route": "hidden states" if args.states else "top-20 rows",
            "model": f"random Qwen3, hidden {args.hidden}, {args.layers} layers, vocabulary {VOCAB}, float32",
            "rows": rows}
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(said, indent=1))
    stem.with_suffix(".md").write_text("\n".join(lines) + f"\n\n{said['cpu']}, {said['load']}, {said['route']}, "
                                                          f"{said['model']}\n")
    print("\n".join(lines))
    print(said["cpu"], "|", said["load"], "|", said["route"], "|", said["model"])


def teacher_dir(scratch: str, args: argparse.Namespace, shapes: list[tuple[int, int, int]]) -> tuple[Path, int]:
    """The random Qwen3 of `--hidden` and `--layers` with its word tokenizer, written under `scratch`,
    and the longest sample of `shapes` + 1 (its max model length)."""
    longest = max(p + r for p, r, _ in shapes) + 1
    directory = Path(scratch) / "qwen3"
    save_tiny_hf(directory, "qwen3", seed=3, max_position_embeddings=longest, **model_shape(args.hidden, args.layers))
    save_word_tokenizer(directory, VOCAB)
    return directory, longest


def shapes_of(text: str | None) -> list[tuple[int, int, int]]:
    """`--shapes` (P/R/G joined by ','), or the issue's two."""
    if not text:
        return list(SHAPES)
    return [(int(p), int(r), int(g)) for p, r, g in (one.split("/") for one in text.split(","))]


def server_cpu(pid: int) -> float:
    """CPU seconds the server's processes (the process and its children: vLLM's engine core) have
    used: a load that stretches wall time hardly moves them."""
    import psutil

    tree = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [tree, *tree.children(recursive=True)])


def blocks_main(args: argparse.Namespace) -> None:
    """serve-teacher at each block size of `--blocks`, asked in turn on each shape (see the module's
    words); per group each server's wall seconds and its processes' CPU seconds (the load-proof figure)."""
    blocks = [int(b) for b in args.blocks.split(",")]
    shapes = shapes_of(args.shapes)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        directory, longest = teacher_dir(scratch, args, shapes)
        launched = {b: launch_server(args.vllm_python, directory, Path(scratch) / f"block-{b}.log",
                                     max_model_len=longest, api_key=KEY, serve_teacher=True,
                                     extra=("--block-size", str(b))) for b in blocks}
        settings = ClientSettings(deadline_s=600)
        with contextlib.ExitStack() as up:
            urls = {b: up.enter_context(serving(server, 900)).url for b, server in launched.items()}
            teachers = {b: up.enter_context(ServedTeacher(url, top_k=20, client=settings)) for b, url in urls.items()}
            loads = [load()]
            for prompt, response, size in shapes:
                first = 1_000 * (prompt + 7 * response)
                for teacher in teachers.values():  # warm: the first request's one-off costs
                    teacher.score(group(prompt, response, size, seed=first + args.groups))
                found: dict[int, list[tuple[float, float, float]]] = {b: [] for b in blocks}
                for turn, seed in enumerate(range(first, first + args.groups)):
                    batch = group(prompt, response, size, seed)
                    for b in blocks if turn % 2 == 0 else list(reversed(blocks)):
                        cpu = server_cpu(launched[b].process.pid)
                        seconds, tokens = timed_group(teachers[b], urls[b], batch)
                        found[b].append((seconds, server_cpu(launched[b].process.pid) - cpu, tokens))
                base = found[max(blocks)]
                for b in blocks:
                    got = found[b]
                    rows.append({"P": prompt, "R": response, "G": size, "block": b,
                                 "seconds": statistics.median(t for t, _, _ in got), "best": min(t for t, _, _ in got),
                                 "cpu": statistics.median(c for _, c, _ in got),
                                 "tokens": statistics.median(n for _, _, n in got),
                                 "ratio": statistics.median(a[0] / u[0] for a, u in zip(got, base, strict=True)),
                                 "cpu_ratio": statistics.median(a[1] / u[1] for a, u in zip(got, base, strict=True)),
                                 "times": [t for t, _, _ in got], "cpus": [c for _, c, _ in got]})
            loads.append(load())
    lines = [f"| P | R | G | block | server CPU s/group (median) | CPU ratio to block {max(blocks)} | wall s/group "
             f"(median / best) | wall ratio | tokens computed a group | once: P + G·R |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['P']} | {r['R']} | {r['G']} | {r['block']} | {r['cpu']:.3f} | {r['cpu_ratio']:.2f} | "
              f"{r['seconds']:.3f} / {r['best']:.3f} | {r['ratio']:.2f} | {r['tokens']:g} | "
              f"{r['P'] + r['G'] * r['R']} |" for r in rows]
    written(Path(args.out) / "serve_teacher_blocks", args, loads, rows, lines)


if __name__ == "__main__":
    main()
