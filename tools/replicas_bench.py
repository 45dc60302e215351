"""A step's teacher time over a teacher's replicas (issue 82 item 6): the failover's and the
hedge's cost, not throughput:

    PYTHONPATH=. .venv/bin/python tools/replicas_bench.py --vllm-python .lanes/vllm/bin/python --out bench-out/replicas

Two vLLM CPU servers of one tiny random Qwen3 on the loopback. Rows: a step's seconds (`--samples`
samples of `--tokens` ids, top-`--k`) asked of one server alone, of both replicas healthy, of both
with one paused (SIGSTOP) just after the step is sent (hedged: `--hedge-after` x the step's median,
at least `--hedge-floor` s), and of both with one killed (SIGKILL) just after it is sent (failed
over; last, once). Every step's scores are checked against the single server's. On a machine's
shared cores a second replica adds no compute: the healthy row is no speed-up. Writes
replicas.json, replicas.md (rows for docs/benchmarks.md) and replicas.png; the load is stated."""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megatron_rl_patches.teachers import ClientSettings, ReplicaSettings, ServedTeacher, TeacherBatch
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer
from megatron_rl_patches.testing.vllm_server import launch, serving

VOCAB = 1001
SHAPE = dict(hidden_size=64, head_dim=32, intermediate_size=96, vocab_size=VOCAB)


def load() -> str:
    return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3]) + f" on {os.cpu_count()} cores"


def batch_of(samples: int, tokens: int, seed: int = 0) -> TeacherBatch:
    gen = torch.Generator().manual_seed(seed)
    return TeacherBatch([torch.randint(0, VOCAB, (tokens,), generator=gen) for _ in range(samples)], [1] * samples)


def timed_step(teacher: ServedTeacher, batch: TeacherBatch, after_send=None):
    """(seconds, scores) of one step; `after_send()` run just after it is sent."""
    start = time.perf_counter()
    pending = teacher.submit(batch)
    if after_send is not None:
        after_send()
    scores = pending.result()
    return time.perf_counter() - start, scores


def same(scores, reference) -> bool:
    return all(torch.equal(a, b) for a, b in zip(scores.topk_ids, reference.topk_ids)) and all(
        torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(scores.topk_log_probs, reference.topk_log_probs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="vLLM CPU build interpreter (.lanes/vllm/bin/python)")
    parser.add_argument("--out", default="bench-out/replicas")
    parser.add_argument("--tokens", type=int, default=256, help="ids per sample of a step")
    parser.add_argument("--samples", type=int, default=8, help="samples per step")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--hedge-after", type=float, default=3.0)
    parser.add_argument("--hedge-floor", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-threads", type=int, default=1,
                        help="OMP_NUM_THREADS of each server (two servers of 2 threads each on 2 cores thrash)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.server_threads)  # read by the servers started below
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"load_before": load(), "tokens": args.tokens, "samples": args.samples, "k": args.k,
                    "hedge_after": args.hedge_after, "hedge_floor_s": args.hedge_floor,
                    "server_threads": args.server_threads}
    settings = ClientSettings(retries=2, backoff_s=0.1, deadline_s=600, timeout_s=600)
    pool = ReplicaSettings(hedge_after=args.hedge_after, hedge_floor_s=args.hedge_floor)
    batch = batch_of(args.samples, args.tokens)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "qwen3"
        save_tiny_hf(directory, "qwen3", seed=1, max_position_embeddings=args.tokens + 8, **SHAPE)
        save_word_tokenizer(directory, VOCAB)
        started = [launch(args.vllm_python, directory, Path(tmp) / f"vllm-{i}.log", max_model_len=args.tokens + 8,
                          max_logprobs=args.k) for i in range(2)]
        with serving(started[0]) as a, serving(started[1]) as b:
            group = b.process.pid

            def pause() -> None:
                os.killpg(group, signal.SIGSTOP)

            with ServedTeacher(a.url, top_k=args.k, client=settings) as alone:
                timed_step(alone, batch_of(1, 64))  # warm: the pool and the server's first request
                times = [timed_step(alone, batch) for _ in range(args.rounds)]
                reference = times[0][1]
                rows.append({"case": "one server", "seconds": statistics.median(t for t, _ in times), "same": True})
            with ServedTeacher([a.url, b.url], top_k=args.k, client=settings, replicas=pool) as teacher:
                timed_step(teacher, batch_of(2, 64))
                for case, after in (("two replicas, healthy", None), ("two replicas, one paused", pause)):
                    times = []
                    for _ in range(args.rounds):
                        try:
                            times.append(timed_step(teacher, batch, after))
                        finally:
                            os.killpg(group, signal.SIGCONT)
                        time.sleep(1.0)  # the paused replica's held requests drain before the next round
                    rows.append({"case": case, "seconds": statistics.median(t for t, _ in times),
                                 "same": all(same(s, reference) for _, s in times)})
                    print(rows[-1], flush=True)
                seconds, scores = timed_step(teacher, batch, lambda: os.killpg(group, signal.SIGKILL))
                rows.append({"case": "two replicas, one killed", "seconds": seconds, "same": same(scores, reference)})
                print(rows[-1], flush=True)
    result["rows"] = rows
    result["load_after"] = load()
    (out / "replicas.json").write_text(json.dumps(result, indent=2))
    write_rows(result, out / "replicas.md")
    plot(result, out / "replicas.png")
    print((out / "replicas.md").read_text())


def write_rows(result: dict, path: Path) -> None:
    healthy = next(row["seconds"] for row in result["rows"] if row["case"] == "two replicas, healthy")
    lines = ["| case | step seconds | against both healthy | scores as one server's |", "|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['case']} | {row['seconds']:.2f} | {row['seconds'] - healthy:+.2f} s | "
                     f"{'yes' if row['same'] else 'NO'} |")
    lines += ["", f"{result['samples']} samples of {result['tokens']} ids, K = {result['k']}, hedge after "
              f"{result['hedge_after']:g} x the step's median (at least {result['hedge_floor_s']:g} s), "
              f"{result['server_threads']} thread(s) per server; "
              f"{result['load_before']} before, {result['load_after']} after."]
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib  # lazy: optional dependency matplotlib (the extra `bench`)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: optional dependency matplotlib (the extra `bench`)

    figure, axis = plt.subplots(figsize=(5.5, 3.2))
    cases = [row["case"] for row in result["rows"]]
    axis.barh(cases, [row["seconds"] for row in result["rows"]], color=["grey", "tab:blue", "tab:orange", "tab:red"])
    axis.invert_yaxis()
    axis.set_xlabel("a step's teacher seconds (vLLM CPU build)")
    axis.set_title(f"a teacher's replicas: {result['samples']} x {result['tokens']} ids, top-{result['k']}",
                   fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
