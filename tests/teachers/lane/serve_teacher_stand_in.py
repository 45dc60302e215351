"""Run by vLLM's interpreter (FastAPI and Starlette are vLLM's): `serve-teacher`'s app
(`apps/serve_teacher/app.py`) over a stand-in engine, asked in process (Starlette's TestClient) what
a careless or hostile client sends; prints one JSON line, {case: [status, message]}, for
test_served_serve_teacher_routes.py to check. No vLLM is imported: the engine is a stand-in with
vLLM's health check (`check_health` raising once its core is dead)."""
from __future__ import annotations

import json
import sys

import torch
from starlette.testclient import TestClient

from megatron_rl_patches.apps.serve_teacher.app import teacher_app

VOCAB, HIDDEN = 16, 8


class Core:
    """vLLM's AsyncLLM as the app asks it: `check_health` raises once the core died."""

    def __init__(self) -> None:
        self.dead = False

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("EngineDeadError: EngineCore encountered an issue")


class StandInEngine:
    """`engine.TeacherEngine` as the app reads it: `--max-logprobs -1`, a [V, H] head, states from a
    fixed function of the ids; `failing` makes its next computation raise as an engine does."""

    name, root, max_model_len, max_logprobs, vocab_size, block_size = "m", "/m", 64, -1, VOCAB, 32

    def __init__(self) -> None:
        self.engine = Core()
        self.head = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
        self.failing: Exception | None = None
        self.asked = 0

    async def states(self, ids: list[int], start: int | None) -> torch.Tensor:
        self.asked += 1
        if self.failing is not None:
            raise self.failing
        first = 0 if start is None else start - 1
        return torch.tensor(ids[first:], dtype=torch.float32)[:, None].repeat(1, HIDDEN) / VOCAB

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return [len(text) % VOCAB]

    def shutdown(self) -> None:
        pass


def answer(reply) -> list:
    body = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else None
    message = body.get("error", {}).get("message") if isinstance(body, dict) and "error" in body else None
    return [reply.status_code, message]


def main() -> None:
    engine = StandInEngine()
    deaths: list[int] = []
    client = TestClient(teacher_app(engine, None, lambda: deaths.append(1)))
    long = "9" * 5000
    said = {}
    for name, raw in {"deep": b"[" * 200_000 + b"]" * 200_000,
                      "deep-field": b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
                      "no-json": b"{not json", "no-utf8": b"\xff\xfe{",
                      "long-id": f'{{"prompt": [1, {long}], "prompt_logprobs": 1}}'.encode(),
                      "long-k": f'{{"prompt": [1, 2], "prompt_logprobs": {long}}}'.encode(),
                      "long-start": f'{{"prompt": [1, 2], "prompt_logprobs": 1, "response_start": {long}}}'.encode(),
                      "model-int": b'{"prompt": [1, 2], "prompt_logprobs": 1, "model": 3}',
                      "k-over-vocab": json.dumps({"prompt": [1, 2], "prompt_logprobs": VOCAB + 1}).encode(),
                      "k-1e9": json.dumps({"prompt": [1, 2], "prompt_logprobs": 10**9}).encode(),
                      "k-2**63": json.dumps({"prompt": [1, 2], "prompt_logprobs": 2**63}).encode(),
                      "k-vocab": json.dumps({"prompt": [1, 2, 3], "prompt_logprobs": VOCAB}).encode()}.items():
        said[name] = answer(client.post("/v1/completions", content=raw))
    said["pooling-deep"] = answer(client.post("/pooling", content=b"[" * 200_000 + b"]" * 200_000))
    said["tokenize-deep"] = answer(client.post("/tokenize", content=b"[" * 200_000 + b"]" * 200_000))
    said["asked-so-far"] = [engine.asked, None]
    engine.failing = RuntimeError("selected index k out of range")  # the engine's own failure: a 500
    said["engine-failed"] = answer(client.post("/v1/completions", json={"prompt": [1, 2], "prompt_logprobs": 1}))
    said["deaths-after-failure"] = [len(deaths), None]
    said["card-alive"] = answer(client.get("/v1/models"))
    engine.engine.dead = True  # the engine core died: the card and /health alike
    said["card-dead"] = answer(client.get("/v1/models"))
    said["health-dead"] = answer(client.get("/health"))
    said["deaths"] = [len(deaths), None]
    print(json.dumps(said))


if __name__ == "__main__":
    sys.setrecursionlimit(1000)
    main()
