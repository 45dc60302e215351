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
        self.asked: list[int | None] = []  # each computation's start
        self.width = HIDDEN  # another width: states the head cannot take (this server's own fault after them)
        self.tokenizer = True
        self.shut = 0

    async def states(self, ids: list[int], start: int | None) -> torch.Tensor:
        self.asked.append(start)
        if self.failing is not None:
            raise self.failing
        return states_of(ids, start, self.width)

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        if not self.tokenizer:
            raise LookupError("Tokenizer not available: the engine was started with --skip-tokenizer-init")
        return [len(text) % VOCAB, int(add_special_tokens)]

    def shutdown(self) -> None:
        self.shut += 1


def states_of(ids: list[int], start: int | None, width: int = HIDDEN) -> torch.Tensor:
    """The stand-in's states of positions start - 1 .. end (every position where start is None)."""
    first = 0 if start is None else start - 1
    return torch.stack([torch.arange(width, dtype=torch.float32) * (i + 1) / 100 for i in ids[first:]])


def answer(reply) -> list:
    body = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else None
    message = body.get("error", {}).get("message") if isinstance(body, dict) and "error" in body else None
    return [reply.status_code, message]


def whole(reply) -> list:
    """[status, the JSON body] (None where it is no JSON)."""
    kind = reply.headers.get("content-type", "")
    return [reply.status_code, reply.json() if kind.startswith("application/json") else None]


def good_replies(client, engine) -> dict:
    """The routes' answers to good requests, beside what they must be (the stand-in's states)."""
    from megatron_rl_patches import __version__
    from megatron_rl_patches.apps.serve_teacher.rows import prompt_log_prob_entries

    said: dict = {}
    ids = [3, 1, 4, 1, 5]
    for start in (None, 3):
        body = {"prompt": ids, "prompt_logprobs": 2, "model": "m", **({} if start is None else {"response_start": 3})}
        reply = client.post("/v1/completions", json=body).json()
        first = 1 if start is None else start
        rows = states_of(ids, start)[:len(ids) - first]
        want = [None] * first + prompt_log_prob_entries(rows, engine.head, ids[first:], 2)
        said[f"completion-{start}"] = [reply["choices"][0]["prompt_logprobs"] == want, engine.asked[-1] == start,
                                      reply["usage"] == {"prompt_tokens": 5, "total_tokens": 5,
                                                         "completion_tokens": 0}, reply["model"] == "m"]
        pooled = client.post("/pooling", json={"input": ids, "encoding_format": "float", **(
            {} if start is None else {"response_start": 3})}).json()
        lead = 0 if start is None else start - 1
        said[f"pooling-float-{start}"] = [pooled["data"][0]["data"] == [[0.0] * HIDDEN] * lead + states_of(
            ids, start).tolist(), pooled["usage"] == {"prompt_tokens": 5, "total_tokens": 5}]
        raw = client.post("/pooling", json={"input": ids, "encoding_format": "bytes", "embed_dtype": "bfloat16",
                                            **({} if start is None else {"response_start": 3})})
        item = json.loads(raw.headers["metadata"])["data"][0]
        sent = torch.frombuffer(bytearray(raw.content), dtype=torch.bfloat16).reshape(item["shape"])
        said[f"pooling-bytes-{start}"] = [torch.equal(sent, states_of(ids, start).to(torch.bfloat16)),
                                          item == {"index": 0, "embed_dtype": "bfloat16", "endianness": "little",
                                                   "shape": [5 - lead, HIDDEN], "start": 0, "end": len(raw.content),
                                                   "first_row": lead}]
    card = client.get("/v1/models").json()["data"][0]
    said["card"] = [card["id"] == "m" and card["root"] == "/m" and card["max_model_len"] == 64,
                    card["megatron_rl_patches"] == {"server": "serve-teacher", "version": __version__,
                                                    "shares_prefix": True, "request_field": "response_start",
                                                    "block_size": 32}]
    said["tokenize"] = whole(client.post("/tokenize", json={"prompt": "abc", "add_special_tokens": False}))
    said["tokenize-default"] = whole(client.post("/tokenize", json={"prompt": "abcd"}))
    said["tokenize-no-text"] = whole(client.post("/tokenize", json={"prompt": 3}))
    said["other-model"] = whole(client.post("/v1/completions", json={"prompt": [1, 2], "prompt_logprobs": 1,
                                                                      "model": "other"}))
    said["bad-request-whole"] = whole(client.post("/v1/completions", json={"prompt": "text", "prompt_logprobs": 1}))
    said["health"] = [client.get("/health").status_code]
    said["metrics"] = [client.get("/metrics").status_code]
    said["no-docs"] = [client.get("/docs").status_code, client.get("/openapi.json").status_code]
    engine.width = HIDDEN + 1  # states the head cannot take: this server's own fault, after the engine answered
    said["own-fault"] = whole(client.post("/v1/completions", json={"prompt": [1, 2], "prompt_logprobs": 1}))
    engine.width = HIDDEN
    engine.tokenizer = False
    said["no-tokenizer"] = answer(client.post("/tokenize", json={"prompt": "abc"}))
    return said


def keyed(engine) -> dict:
    """Every route behind the API key: 401 without it or with another, the route with it."""
    keyed_client = TestClient(teacher_app(engine, "k", lambda: None))
    said = {}
    for headers in ({}, {"Authorization": "Bearer x"}, {"Authorization": "Bearer k"}):
        reply = keyed_client.get("/v1/models", headers=headers)
        said[headers.get("Authorization", "none")] = [reply.status_code, reply.json()]
    return said


def main() -> None:
    engine = StandInEngine()
    deaths: list[int] = []
    with TestClient(teacher_app(engine, None, lambda: deaths.append(1))) as client:  # its lifespan run
        said = good_replies(client, engine)
    said["shut-once"] = [engine.shut]
    said["keyed"] = keyed(StandInEngine())
    engine = StandInEngine()
    client = TestClient(teacher_app(engine, None, lambda: deaths.append(1)))
    said.update(hostile(client, engine, deaths))
    print(json.dumps(said))


def hostile(client, engine, deaths: list[int]) -> dict:
    """What a careless or hostile client sends, and a dead engine."""
    long = "9" * 5000
    said: dict = {}
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
    said["asked-so-far"] = [len(engine.asked), None]
    engine.failing = RuntimeError("selected index k out of range")  # the engine's own failure: a 500
    said["engine-failed"] = answer(client.post("/v1/completions", json={"prompt": [1, 2], "prompt_logprobs": 1}))
    said["engine-failed-whole"] = whole(client.post("/pooling", json={"input": [1, 2]}))
    said["deaths-after-failure"] = [len(deaths), None]
    said["card-alive"] = answer(client.get("/v1/models"))
    engine.engine.dead = True  # the engine core died: the card and /health alike
    said["card-dead"] = whole(client.get("/v1/models"))
    said["health-dead"] = answer(client.get("/health"))
    said["deaths"] = [len(deaths), None]
    return said


if __name__ == "__main__":
    sys.setrecursionlimit(1000)
    main()
