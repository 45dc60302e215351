"""A step's teacher time, served vs in-process, for one tiny model (issue 65 item 6):

    PYTHONPATH=. .venv/bin/python tools/served_bench.py --vllm-python .lanes/vllm/bin/python --out bench-out/served

A tiny random Qwen3 (transformers, float32) is served by vLLM's CPU build on the loopback and run
in this process by transformers (its forward, log-softmax, top-k and tail: what an in-process
teacher computes). Rows: tokens/s of a step of `--samples` samples of `--tokens` ids each, served
with 1..N requests in flight and in-process; the client's own share of a served request (JSON
decoding and reading the reply into tensors) against the server's time, at K = `--k`. Writes
served.json, served.md (rows for docs/benchmarks.md) and served.png; the machine's load is stated."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, TeacherBatch
from megatron_rl_patches.teachers.served.engines.vllm import VllmEngine
from megatron_rl_patches.teachers.served.http import TeacherClient, decode, fast_loads
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer
from megatron_rl_patches.testing.vllm_server import vllm_server

VOCAB = 1001
SHAPE = dict(hidden_size=64, head_dim=32, intermediate_size=96, vocab_size=VOCAB)


def load() -> str:
    return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3]) + f" on {os.cpu_count()} cores"


def batch_of(samples: int, tokens: int, seed: int = 0) -> TeacherBatch:
    gen = torch.Generator().manual_seed(seed)
    return TeacherBatch([torch.randint(0, VOCAB, (tokens,), generator=gen) for _ in range(samples)], [1] * samples)


def median_seconds(run, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_process(model, batch: TeacherBatch, k: int) -> None:
    """What an in-process teacher does for the same rows: forward, log-softmax, top-k, tail."""
    with torch.no_grad():
        for ids in batch.sequences:
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), dim=-1)
            top = logp.topk(k)
            torch.log1p(-top.values.exp().sum(-1).clamp(max=1 - 1e-7))


def client_share(teacher: ServedTeacher, ids: list[int], rounds: int) -> dict:
    """Seconds of one request at the server (the HTTP round trip on the loopback) and of the
    client's own work on its reply (JSON decoding, then the reply read into tensors)."""
    model = teacher.check()
    engine = VllmEngine(TeacherClient(teacher.url, teacher.settings), teacher.top_k, None)  # its routes, asked by hand
    http = engine.client.http()
    body = engine.body(model, ids)
    server, decoding, parse, size = [], [], [], 0
    for _ in range(rounds):
        start = time.perf_counter()
        content = http.post(teacher.url + engine.path, json=body).content
        server.append(time.perf_counter() - start)
        start = time.perf_counter()
        reply = decode(content, "", "", None)
        decoding.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.parse(reply, ids, 1, 0)
        parse.append(time.perf_counter() - start)
        size = len(content)
    s, d, p = (statistics.median(v) for v in (server, decoding, parse))
    return {"tokens": len(ids), "reply_bytes": size, "server_s": s, "json_s": d, "read_s": p,
            "client_share": (d + p) / s, "decoder": fast_loads().__module__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="vLLM CPU build interpreter (.lanes/vllm/bin/python)")
    parser.add_argument("--out", default="bench-out/served")
    parser.add_argument("--tokens", type=int, default=2048, help="ids per sample of a step")
    parser.add_argument("--share-tokens", type=int, default=8192, help="ids of the client-share sample")
    parser.add_argument("--samples", type=int, default=8, help="samples per step")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    result: dict = {"load_before": load(), "tokens": args.tokens, "samples": args.samples, "k": args.k}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "qwen3"
        longest = max(args.tokens, args.share_tokens) + 8
        model = save_tiny_hf(directory, "qwen3", seed=1, max_position_embeddings=longest, **SHAPE)
        save_word_tokenizer(directory, VOCAB)
        batch = batch_of(args.samples, args.tokens)
        step_tokens = args.samples * (args.tokens - 1)
        with vllm_server(args.vllm_python, directory, Path(tmp) / "vllm.log", max_model_len=longest,
                         max_logprobs=args.k) as server:
            rows = []
            for n in args.in_flight:
                settings = ClientSettings(max_in_flight=n, max_tokens_in_flight=n * args.tokens, deadline_s=3600,
                                          timeout_s=3600)
                with ServedTeacher(server.url, top_k=args.k, client=settings) as teacher:
                    teacher.score(batch_of(1, 64))  # warm: the pool and the server's first request
                    seconds = median_seconds(lambda t=teacher: t.score(batch), args.rounds)
                rows.append({"in_flight": n, "seconds": seconds, "tokens_per_s": step_tokens / seconds})
                print(f"served, {n} in flight: {step_tokens / seconds:,.0f} tokens/s", flush=True)
            with ServedTeacher(server.url, top_k=args.k, client=ClientSettings(timeout_s=3600)) as teacher:
                share_ids = batch_of(1, args.share_tokens, seed=1).sequences[0].tolist()
                result["client"] = client_share(teacher, share_ids, args.rounds)
            print(f"client share: {result['client']['client_share']:.1%}", flush=True)
        in_process(model, batch_of(1, 64), args.k)
        seconds = median_seconds(lambda: in_process(model, batch, args.k), args.rounds)
        result["in_process"] = {"seconds": seconds, "tokens_per_s": step_tokens / seconds}
        result["served"] = rows
    result["load_after"] = load()
    result["torch_threads"] = torch.get_num_threads()
    (out / "served.json").write_text(json.dumps(result, indent=2))
    write_rows(result, out / "served.md")
    plot(result, out / "served.png")
    print((out / "served.md").read_text())


def write_rows(result: dict, path: Path) -> None:
    lines = ["| route | requests in flight | step seconds | tokens/s |", "|---|---|---|---|"]
    for row in result["served"]:
        lines.append(f"| served (vLLM CPU) | {row['in_flight']} | {row['seconds']:.2f} | {row['tokens_per_s']:,.0f} |")
    ip = result["in_process"]
    lines.append(f"| in-process (transformers) | - | {ip['seconds']:.2f} | {ip['tokens_per_s']:,.0f} |")
    c = result["client"]
    lines += ["", "| tokens per sample | reply MB | server s | JSON decoding s | read into tensors s | client share |",
              "|---|---|---|---|---|---|",
              f"| {c['tokens']} | {c['reply_bytes'] / 1e6:.1f} | {c['server_s']:.3f} | {c['json_s']:.3f} "
              f"({c['decoder']}) | {c['read_s']:.3f} | {c['client_share']:.1%} |",
              "", f"{result['samples']} samples of {result['tokens']} ids, K = {result['k']}; "
              f"{result['load_before']} before, {result['load_after']} after."]
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib  # lazy: optional dependency matplotlib (the extra `bench`)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: optional dependency matplotlib (the extra `bench`)

    figure, axis = plt.subplots(figsize=(5.5, 3.5))
    flights = [row["in_flight"] for row in result["served"]]
    axis.plot(flights, [row["tokens_per_s"] for row in result["served"]], "o-", label="served (vLLM CPU build)")
    axis.axhline(result["in_process"]["tokens_per_s"], color="grey", linestyle="--", label="in-process (transformers)")
    axis.set_xscale("log", base=2)
    axis.set_xticks(flights, [str(f) for f in flights])
    axis.set_xlabel("requests in flight")
    axis.set_ylabel("scored tokens / s")
    axis.set_title(f"teacher top-{result['k']} + tail, {result['samples']} x {result['tokens']} ids", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
