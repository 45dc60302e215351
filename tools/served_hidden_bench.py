"""A hidden-state teacher's costs on the server's side (issue 74 item 6): ONE vLLM CPU generate
server and ONE pooling server of a tiny random Qwen3 with Qwen3's vocabulary (V = 151,936, H = 64),
one after the other, each measured alone:

    MRP_VLLM_PYTHON=$PWD/.lanes/vllm/bin/python PYTHONPATH=. .venv/bin/python tools/served_hidden_bench.py \
        --out bench-out/served_hidden

per sample of T = 1k / 4k / 8k tokens: the request's time (loopback, the client's wall clock of one
request: the server's work plus the local transfer; the best of `--repeats`), the server's peak
memory while it answered (resident set of the server's whole process tree, sampled every 5 ms, above
its level before the request) and the reply's bytes on the wire: `prompt_logprobs` K = 20 (the
engine forms [T, V] log-probs) against `/pooling` hidden states as float32 and bfloat16 binary
(the engine never forms [T, V]). Writes served_hidden.json, served_hidden.md and served_hidden.png; states the load."""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import torch

from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer
from megatron_rl_patches.testing.vllm_server import vllm_server

VOCAB = 151_936
SHAPE = dict(hidden_size=64, head_dim=32, intermediate_size=96, vocab_size=VOCAB)
POOLING = ("--runner", "pooling", "--convert", "embed", "--pooler-config", '{"task": "token_embed"}')
K = 20


def load() -> str:
    return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3]) + f" on {os.cpu_count()} cores"


class TreePeak:
    """The peak resident set of a process and its descendants while the block runs, above its level before."""

    def __init__(self, pid: int) -> None:
        root = psutil.Process(pid)
        self.procs = [root, *root.children(recursive=True)]
        self.before = self.rss()
        self.peak = self.before
        self.done = threading.Event()

    def rss(self) -> int:
        total = 0
        for proc in self.procs:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                pass
        return total

    def __enter__(self) -> TreePeak:
        def sample() -> None:
            while not self.done.wait(0.005):
                self.peak = max(self.peak, self.rss())
        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self.rss())


def post(url: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return reply.read()


def measure(server: Any, path: str, body: dict[str, Any], repeats: int) -> dict[str, Any]:
    times, peaks, size = [], [], 0
    for _ in range(repeats):
        with TreePeak(server.process.pid) as peak:
            start = time.perf_counter()
            size = len(post(server.url + path, body))
            times.append(time.perf_counter() - start)
        peaks.append((peak.peak - peak.before, peak.peak))
    return {"seconds": min(times), "peak_above_bytes": max(p[0] for p in peaks),
            "peak_rss_bytes": max(p[1] for p in peaks), "reply_bytes": size}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    model = out / "model"
    config = model / "config.json"
    if not config.exists() or json.loads(config.read_text())["max_position_embeddings"] < args.max_len:
        save_tiny_hf(model, "qwen3", seed=0, max_position_embeddings=args.max_len, **SHAPE)
        save_word_tokenizer(model, VOCAB)
    gen = torch.Generator().manual_seed(0)
    samples = {t: torch.randint(0, VOCAB, (t,), generator=gen).tolist() for t in args.tokens}
    kinds = {
        f"prompt_logprobs K={K} (JSON)": ((), "/v1/completions",
                                          lambda ids: {"model": str(model), "prompt": ids, "max_tokens": 1,
                                                       "prompt_logprobs": K, "detokenize": False}),
        "pooling fp32 (binary)": (POOLING, "/pooling", lambda ids: pooling(model, ids, "float32")),
        "pooling bf16 (binary)": (POOLING, "/pooling", lambda ids: pooling(model, ids, "bfloat16")),
    }
    rows: list[dict[str, Any]] = []
    started: dict[tuple[str, ...], float] = {}
    for extra in dict.fromkeys(extra for extra, _, _ in kinds.values()):  # one server per runner
        begin = time.perf_counter()
        with vllm_server(args.python, model, out / f"vllm{'-pooling' if extra else ''}.log",
                         max_model_len=args.max_len, max_logprobs=K, extra=extra) as server:
            started[extra] = time.perf_counter() - begin
            for name, (own, path, body) in kinds.items():
                if own != extra:
                    continue
                post(server.url + path, body(samples[min(samples)][:64]))  # warm-up
                for t, ids in samples.items():
                    # [T, V] float32 logits and log-probs, with room; vLLM's CPU build prefills 2,048
                    # tokens a step (measured: 1.2 GiB above idle at 1k, 2.3 GiB at 4k)
                    need = 3 * min(t, 2048) * VOCAB * 4
                    if path != "/pooling" and psutil.virtual_memory().available < need + 2 ** 31:
                        print(f"{name} at T={t}: skipped, under {(need + 2 ** 31) / 2 ** 30:.1f} GiB free", flush=True)
                        continue
                    row = {"kind": name, "tokens": t, **measure(server, path, body(ids), args.repeats)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return {"load": load(), "vocab": VOCAB, "hidden": SHAPE["hidden_size"], "rows": rows,
            "server_start_seconds": {"generate": started[()], "pooling": started[POOLING]}}


def pooling(model: Path, ids: list[int], dtype: str) -> dict[str, Any]:
    return {"model": str(model), "input": ids, "task": "token_embed", "use_activation": False,
            "encoding_format": "bytes", "embed_dtype": dtype, "endianness": "little", "add_special_tokens": False}


def table(result: dict[str, Any]) -> str:
    base = {r["tokens"]: r for r in result["rows"] if r["kind"].startswith("prompt_logprobs")}
    lines = ["| reply | T | time (s) | × K=20's time | peak above idle (MiB) | server RSS peak (MiB) "
             "| reply bytes | bytes / token |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if r["tokens"] not in base:
            continue
        mib, ratio = 2 ** 20, r["seconds"] / base[r["tokens"]]["seconds"]
        lines.append(f"| {r['kind']} | {r['tokens']:,} | {r['seconds']:.3f} | {ratio:.3f} "
                     f"| {r['peak_above_bytes'] / mib:,.1f} | {r['peak_rss_bytes'] / mib:,.0f} | {r['reply_bytes']:,} "
                     f"| {r['reply_bytes'] / r['tokens']:,.0f} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], file: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in dict.fromkeys(r["kind"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["kind"] == kind]
        ts = [r["tokens"] for r in rows]
        left.plot(ts, [r["seconds"] for r in rows], marker="o", label=kind)
        right.plot(ts, [r["peak_above_bytes"] / 2 ** 20 for r in rows], marker="o", label=kind)
    left.set(xlabel="tokens per sample", ylabel="seconds per request", title="server time (loopback)")
    right.set(xlabel="tokens per sample", ylabel="MiB above idle", title="server peak RSS while answering")
    left.legend(fontsize=8)
    fig.suptitle(f"vLLM CPU, V = {VOCAB:,}, H = {result['hidden']}: prompt_logprobs K=20 vs pooling hidden states")
    fig.tight_layout()
    fig.savefig(file, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-out/served_hidden")
    parser.add_argument("--python", default=os.environ.get("MRP_VLLM_PYTHON", ""),
                        help="vLLM's interpreter (the served lane's venv; default $MRP_VLLM_PYTHON)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if not args.python:
        parser.error("--python PATH or MRP_VLLM_PYTHON: vLLM's interpreter (.lanes/vllm/bin/python)")
    args.max_len = max(args.tokens) + 8  # the prompt and the one generated token
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = run(args)
    (Path(args.out) / "served_hidden.json").write_text(json.dumps(result, indent=2))
    (Path(args.out) / "served_hidden.md").write_text(table(result) + f"\n\n{result['load']}\n")
    plot(result, Path(args.out) / "served_hidden.png")
    print(table(result))
    print(result["load"], "servers ready in", result["server_start_seconds"])


if __name__ == "__main__":
    main()
