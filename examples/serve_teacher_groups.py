"""GRPO groups scored by a running `megatron-rl-patches serve-teacher` (docs/distillation.md, "A group's
prompt computed once"), with the prompt tokens its engine computed for each group: G samples of one
prompt of P tokens and responses of R cost P + G·R there, where a stock vLLM server computes each
sample whole, G·(P + R). The tokens are the server's own count (vLLM's
`vllm:prompt_tokens_by_source_total{source="local_compute"}` on its `/metrics`), read before and after
each group.

    .venv/bin/python examples/serve_teacher_groups.py --url http://127.0.0.1:8000 \
        [--groups 2] [--group-size 8] [--prompt 96] [--response 24]

The server's prefix cache holds whole KV blocks (32 tokens on CPU, said on its start-up line and its
card): a prompt shorter than one block shares nothing, so the prompts here are 96 tokens by default.
Ids are drawn at random below --vocab-size (1001: the tiny teacher `examples/served_teacher_loop.py
--save-teacher DIR` writes). A server started with a key: the key in
$MEGATRON_RL_PATCHES_TEACHER_API_KEY. Pointed at a stock vLLM server instead, it prints what that
computes (G·(P + R) a group).
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import torch

from megatron_rl_patches.settings import TEACHER_API_KEY
from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, TeacherBatch

COMPUTED = "vllm:prompt_tokens_by_source_total{"  # vLLM's prompt tokens by source: computed, cached, ...
CARD_FIELD = "megatron_rl_patches"  # serve-teacher's field of the model card


def computed_tokens(metrics: str) -> float | None:
    """The prompt tokens the engine computed so far, from its Prometheus text (None: no such counter)."""
    found = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
             if line.startswith(COMPUTED) and 'source="local_compute"' in line]
    return sum(found) if found else None


def one_group(gen: torch.Generator, size: int, prompt: int, response: int, vocab: int) -> TeacherBatch:
    """G samples of one prompt of P ids, each with its own response of R ids (distinct first ids: a
    response agreeing with another's would share more than the prompt)."""
    shared = torch.randint(0, vocab, (prompt,), generator=gen)
    firsts = torch.randperm(vocab, generator=gen)[:size]
    sequences = [torch.cat([shared, firsts[i:i + 1], torch.randint(0, vocab, (response - 1,), generator=gen)])
                 for i in range(size)]
    return TeacherBatch(sequences, [prompt] * size)


def fewer(computed: float, whole: int) -> str:
    """How many fewer prompt tokens than each sample whole, in words."""
    if computed <= 0:
        return "none: every token read from the cache (this group was asked before)"
    if computed >= whole:
        return "no fewer: nothing shared"
    return f"{whole / computed:.1f}x fewer" if whole / computed >= 1.05 else f"{whole - computed:.0f} fewer"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8, help="G: samples of one prompt")
    parser.add_argument("--prompt", type=int, default=96, help="P: prompt tokens (more than one KV block to share)")
    parser.add_argument("--response", type=int, default=24, help="R: response tokens of each sample")
    parser.add_argument("--vocab-size", type=int, default=1001, help="ids are drawn below it (the teacher's)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("groups", "group_size", "prompt", "response", "vocab_size", "top_k"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")

    import httpx  # the extra `served` (in the package's .venv)

    url = args.url.rstrip("/")
    key = os.environ.get(TEACHER_API_KEY)
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def counted() -> float | None:
        return computed_tokens(httpx.get(f"{url}/metrics", headers=headers, timeout=30).raise_for_status().text)

    try:
        card = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).raise_for_status().json()["data"][0]
    except httpx.HTTPError as failed:
        parser.exit(1, f"{url}: no model card ({type(failed).__name__}: {failed}); is the server up? "
                       f"(`curl {url}/health` answers 200 once it is)\n")
    ours = card.get(CARD_FIELD) or {}
    block = ours.get("block_size")
    print(f"{url}: " + (f"serve-teacher, KV blocks of {block} tokens" if block else
                        "a stock vLLM server (each sample computed whole)"))
    if block and args.prompt < block:
        print(f"  (a prompt of {args.prompt} tokens is under one block of {block}: nothing is shared)")
    if counted() is None:
        parser.error(f"{url}/metrics has no {COMPUTED}...}}: this example needs vLLM 0.32's counters")
    gen = torch.Generator().manual_seed(args.seed)
    whole = args.group_size * (args.prompt + args.response)
    once = args.prompt + args.group_size * args.response
    results = []
    with ServedTeacher(url, top_k=args.top_k, client=ClientSettings(retries=1, deadline_s=300.0)) as teacher:
        teacher.check()  # the client's first question (the model, K within its limit) before any group is counted
        for index in range(args.groups):
            batch = one_group(gen, args.group_size, args.prompt, args.response, args.vocab_size)
            before = counted()
            scores = teacher.score(batch)
            computed = (counted() or 0.0) - (before or 0.0)
            print(f"group {index + 1}: {args.group_size} samples, a prompt of {args.prompt} tokens, responses of "
                  f"{args.response}: computed {computed:.0f} prompt tokens, {whole} each sample whole "
                  f"({fewer(computed, whole)}; once is {once})", flush=True)
            results.append({"computed": computed, "whole": whole, "once": once,
                            "rows": [int(r.shape[0]) for r in scores.token_log_probs]})
    return results


if __name__ == "__main__":
    main()
