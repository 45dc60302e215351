"""For `../shared/tools/ab-bench REV_A REV_B -- python tools/ab/served_step.py`: a served teacher's
step, timed on the client's side. One real vLLM CPU server (a tiny random Qwen3) is started once,
outside the A/B, and named by MRP_AB_SERVED_URL; each run builds `ServedTeacher(url, top_k=K)`
from the revision on PYTHONPATH (ab-bench puts it first), scores one warm-up batch, then
`--rounds` steps of `--samples` samples. One JSON line: the median wall seconds of a step (the
server's time included) and the median CPU seconds this process spent in a step (the client's
own work: requests, JSON decoding, replies read into tensors, scheduling), which is what a
change of the client moves. Start the server with `--serve` (it prints the URL and waits):

    .venv/bin/python tools/ab/served_step.py --serve --vllm-python .lanes/vllm/bin/python &
    MRP_AB_SERVED_URL=http://127.0.0.1:PORT ../shared/tools/ab-bench -n 5 REV_A REV_B -- \\
        .venv/bin/python tools/ab/served_step.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

VOCAB = 1001
SHAPE = dict(hidden_size=64, head_dim=32, intermediate_size=96, vocab_size=VOCAB)


def serve(vllm_python: str, max_len: int, k: int) -> None:
    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer
    from megatron_rl_patches.testing.vllm_server import vllm_server

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "qwen3"
        save_tiny_hf(directory, "qwen3", seed=1, max_position_embeddings=max_len, **SHAPE)
        save_word_tokenizer(directory, VOCAB)
        with vllm_server(vllm_python, directory, Path(tmp) / "vllm.log", max_model_len=max_len,
                         max_logprobs=k) as server:
            print(server.url, flush=True)
            while True:
                time.sleep(60)


def step_times(url: str, samples: int, tokens: int, k: int, rounds: int) -> dict:
    from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, TeacherBatch

    gen = torch.Generator().manual_seed(0)
    batch = TeacherBatch([torch.randint(0, VOCAB, (tokens,), generator=gen) for _ in range(samples)], [1] * samples)
    walls, cpus = [], []
    with ServedTeacher(url, top_k=k, client=ClientSettings(timeout_s=600, deadline_s=600)) as teacher:
        teacher.score(TeacherBatch([batch.sequences[0][:32]], [1]))  # warm: the pool and the server
        for _ in range(rounds):
            wall, cpu = time.perf_counter(), time.process_time()
            teacher.score(batch)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return {"step_s": statistics.median(walls), "client_cpu_s": statistics.median(cpus)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help="start the server, print its URL and wait")
    parser.add_argument("--vllm-python", default=".lanes/vllm/bin/python")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.serve:
        serve(args.vllm_python, args.tokens + 8, args.k)
        return
    url = os.environ.get("MRP_AB_SERVED_URL")
    if not url:
        raise SystemExit("served_step.py: set MRP_AB_SERVED_URL to a server started with --serve")
    print(json.dumps(step_times(url, args.samples, args.tokens, args.k, args.rounds)))


if __name__ == "__main__":
    main()
