"""A hidden-state teacher's costs on the trainer's side (issue 74 item 6), no server needed:

    PYTHONPATH=. .venv/bin/python tools/hidden_bench.py --out bench-out/hidden

1. The wire, per token: a pooling reply's hidden states (2H bytes in bf16, 4H in fp32) against
   vLLM's K = 20 `prompt_logprobs` JSON (an entry per position of K + 1 ids, each with its
   logprob, rank and decoded_token, as vLLM writes them), at H = 64, 4096 and 7168; and the
   client's decode time of a reply of `--tokens` tokens: the binary reply read into the response
   rows (`VllmPoolingEngine.rows`) against the JSON reply decoded and read into tensors
   (`VllmEngine.parse`). The replies are synthetic, of the exact size and shape a server sends.
2. The head pass, per sample of T tokens at V = `--vocab` (tiny H): the teacher's top-k through its
   head (K = 20, 64; `TeacherHead.topk`) and the full-vocabulary divergence forward + backward
   (`lm_head_divergence`, reverse KL) against the student's own fused log-prob + entropy forward +
   backward (`lm_head_log_probs_and_entropy`) at the same T and V.
Writes hidden.json and hidden.md (rows for docs/benchmarks.md); the machine's load is stated."""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from megatron_rl_patches import lm_head_divergence, lm_head_log_probs_and_entropy
from megatron_rl_patches.teachers import ClientSettings, TeacherHead
from megatron_rl_patches.teachers.served.engines.vllm import VllmEngine
from megatron_rl_patches.teachers.served.engines.vllm_pooling import VllmPoolingEngine
from megatron_rl_patches.teachers.served.http import TeacherClient, decode

URL = "http://127.0.0.1:9"
JSON_K = 20


def load() -> str:
    return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3]) + f" on {os.cpu_count()} cores"


def median_seconds(run, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def json_reply(tokens: int, k: int, vocab: int) -> tuple[bytes, list[int]]:
    """vLLM's /v1/completions reply with prompt_logprobs=k for `tokens` ids (the actual id outside
    the top-k: k + 1 entries a position), as bytes."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(k + 1, vocab, (tokens,), generator=gen).tolist()
    # log-probs whose k + 1 masses sum below 1, as a real distribution's
    drawn = -torch.rand(tokens, k + 1, generator=gen) * 20 - math.log(k + 2)
    values = drawn.sort(dim=1, descending=True).values.tolist()
    positions: list = [None]
    for p in range(1, tokens):
        entry = {str(j): {"logprob": values[p][j], "rank": j + 1, "decoded_token": None} for j in range(k)}
        entry[str(ids[p])] = {"logprob": values[p][k], "rank": 500, "decoded_token": None}
        positions.append(entry)
    body = {"id": "cmpl-0", "object": "text_completion", "model": "teacher",
            "choices": [{"index": 0, "text": "", "prompt_logprobs": positions, "logprobs": None,
                         "finish_reason": "length"}]}
    return json.dumps(body).encode(), ids


def binary_reply(tokens: int, hidden: int, dtype: torch.dtype) -> SimpleNamespace:
    """vLLM's binary /pooling reply of one input of `tokens` rows."""
    states = torch.randn(tokens, hidden).to(dtype)
    body = states.view(torch.uint8).numpy().tobytes()
    item = {"index": 0, "embed_dtype": {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
            "endianness": "little", "start": 0, "end": len(body), "shape": [tokens, hidden]}
    return SimpleNamespace(headers={"metadata": json.dumps({"data": [item]})}, content=body)


def wire(tokens: int, vocab: int, rounds: int) -> list[dict]:
    client = TeacherClient(URL, ClientSettings())
    raw, ids = json_reply(tokens, JSON_K, vocab)
    engine = VllmEngine(client, JSON_K, None)
    json_s = median_seconds(lambda: engine.parse(decode(raw, "bench", URL, 0), ids, 1, 0), rounds)
    rows = [{"reply": f"K = {JSON_K} prompt_logprobs JSON", "hidden": "-", "bytes_per_token": len(raw) / tokens,
             "decode_s": json_s}]
    for hidden in (64, 4096, 7168):
        for dtype in (torch.bfloat16, torch.float32):
            reply = binary_reply(tokens, hidden, dtype)
            pooling = VllmPoolingEngine(client, JSON_K, None, hidden, dtype)
            seconds = median_seconds(lambda e=pooling, r=reply: e.rows(r, tokens, 1, 0), rounds)
            rows.append({"reply": f"hidden states, {str(dtype).removeprefix('torch.')}", "hidden": hidden,
                         "bytes_per_token": len(reply.content) / tokens, "decode_s": seconds})
            print(rows[0] if len(rows) == 2 else "", rows[-1], flush=True)  # partial rows survive a timeout
    return rows


def head_pass(tokens: int, vocab: int, hidden: int, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    teacher = TeacherHead(torch.randn(vocab, hidden, generator=gen) * 0.1, vocab, vocab, 0, source="bench")
    t_hidden = torch.randn(tokens, hidden, generator=gen)
    s_weight = (torch.randn(vocab, hidden, generator=gen) * 0.1).requires_grad_()
    s_hidden = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)

    def student() -> None:
        lp, ent = lm_head_log_probs_and_entropy(s_hidden, s_weight, labels, with_entropy=True)
        assert ent is not None
        (lp.sum() + ent.sum()).backward()

    def divergence() -> None:
        lm_head_divergence(s_hidden, s_weight, t_hidden, teacher.weight, divergence="reverse_kl").sum().backward()

    out = {"tokens": tokens, "vocab": vocab, "hidden": hidden,
           "student_fused_fwd_bwd_s": median_seconds(student, rounds),
           "divergence_fwd_bwd_s": median_seconds(divergence, rounds)}
    for k in (20, 64):
        out[f"topk{k}_s"] = median_seconds(lambda k=k: teacher.topk(t_hidden, k), rounds)
    print(out, flush=True)
    return out


def markdown(wire_rows: list[dict], heads: list[dict], tokens: int, before: str, after: str) -> str:
    lines = [f"Measured {time.strftime('%Y-%m-%d')}: {before} before, {after} after.", "",
             f"| reply ({tokens} tokens) | H | bytes per token | client decode s | decode µs per token |",
             "|---|---|---|---|---|"]
    for row in wire_rows:
        lines.append(f"| {row['reply']} | {row['hidden']} | {row['bytes_per_token']:,.0f} | {row['decode_s']:.4f} | "
                     f"{row['decode_s'] / tokens * 1e6:.2f} |")
    lines += ["", "| T | V | H | student fused fwd+bwd s | divergence fwd+bwd s | ratio | top-20 s | top-64 s |",
              "|---|---|---|---|---|---|---|---|"]
    for h in heads:
        ratio = h["divergence_fwd_bwd_s"] / h["student_fused_fwd_bwd_s"]
        lines.append(f"| {h['tokens']} | {h['vocab']:,} | {h['hidden']} | {h['student_fused_fwd_bwd_s']:.3f} | "
                     f"{h['divergence_fwd_bwd_s']:.3f} | {ratio:.2f}x | {h['topk20_s']:.3f} | {h['topk64_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-out/hidden")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the replies decoded")
    parser.add_argument("--head-tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--head-hidden", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    before = load()
    wire_rows = wire(args.tokens, args.vocab, args.rounds)
    heads = [head_pass(t, args.vocab, args.head_hidden, args.rounds) for t in args.head_tokens]
    after = load()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hidden.json").write_text(json.dumps({"wire": wire_rows, "head": heads, "load": [before, after]}, indent=1))
    text = markdown(wire_rows, heads, args.tokens, before, after)
    (out / "hidden.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
