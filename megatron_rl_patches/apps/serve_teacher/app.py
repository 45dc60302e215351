"""The HTTP side of `serve-teacher` (`teacher_app`), on FastAPI as vLLM's own server is: the routes
`ServedTeacher` speaks, in the JSON shapes vLLM 0.32's server answers them with —

- `GET /v1/models`: the card (`id`, `root`, `max_model_len`) and this server's field `CARD_FIELD`
  (the client then sends `response_start`);
- `POST /tokenize`: `{"prompt": text, "add_special_tokens"}` -> `{"tokens", "count", "max_model_len"}`;
- `POST /v1/completions` with `prompt` (ids) and `prompt_logprobs` K: `choices[0].prompt_logprobs`,
  one entry per id (the first None), the top-k and the actual id with their log-probs and ranks;
  nothing is generated (`text` is "");
- `POST /pooling` with `input` (ids), `task: token_embed`: the final hidden state per id, as JSON
  floats or as bytes with the `metadata` header;
- `GET /health`, `GET /metrics` (the engine's Prometheus counters).

With `response_start` (the field this server adds) only the rows from the response start - 1 on
are computed and sent: log-prob entries before it are None, a pooling reply's rows start at its
`first_row`. Every route asks for the API key (`Authorization: Bearer KEY`) when one is set; the key
is compared in constant time and never written to a reply or a log. A request the engine never runs
(a body that is no JSON, a field out of range) is a 400 naming the body or the field (`bodies`);
only what the engine itself raised is a 500. A dead engine answers 500 (a scoring request) or 503
(`/health` and the card alike) and stops the server, so a client fails over to another replica.

(No `from __future__ import annotations` here: FastAPI reads the routes' annotations at definition.)"""
# lazy imports: import cost: vLLM, FastAPI, uvicorn and prometheus_client load only when the command runs

import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import torch

from megatron_rl_patches.apps.serve_teacher import bodies
from megatron_rl_patches.apps.serve_teacher.rows import prompt_log_prob_entries

CARD_FIELD = "megatron_rl_patches"  # the card's field naming this server and what it takes
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def card_extension(block_size: int) -> dict[str, Any]:
    from megatron_rl_patches import __version__

    return {"server": "serve-teacher", "version": __version__, "shares_prefix": True,
            "request_field": bodies.RESPONSE_START, "block_size": block_size}


def error(status: int, message: str) -> Any:
    from fastapi.responses import JSONResponse

    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(status,
                                                                                          "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)


class EngineFailed(Exception):
    """What the engine raised computing a request (the 500 that names it)."""

    def __init__(self, failed: BaseException) -> None:
        super().__init__(f"{type(failed).__name__}: {failed}")


def teacher_app(engine: Any, api_key: str | None, on_engine_death: Callable[[], None]) -> Any:
    """The FastAPI app over `engine` (`engine.TeacherEngine`)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # the engine stopped here, inside uvicorn's serve: after it, uvicorn re-raises the SIGTERM it
        # caught and the process ends before any code after serve() runs (its engine core left behind)
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(openapi_url=None, lifespan=lifespan)  # no schema route, so no docs pages (served from it)
    wanted = f"Bearer {api_key}".encode() if api_key else None

    @app.middleware("http")
    async def authorized(request: Request, call_next: Callable[[Request], Awaitable[Any]]) -> Any:
        if wanted is not None and not hmac.compare_digest(request.headers.get("authorization", "").encode(), wanted):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    async def computed(ids: list[int], start: int | None) -> torch.Tensor:
        try:
            return await engine.states(ids, start)
        except Exception as failed:  # noqa: BLE001 - whatever the engine raised: its failure, a 500
            await alive()  # a dead engine (vLLM's EngineDeadError) stops the server
            raise EngineFailed(failed) from failed

    async def answered(request: Request, answer: Callable[[Any], Awaitable[Any]]) -> Any:
        try:
            body = bodies.read_body(await request.body())
            if isinstance(body, dict):
                bodies.served_model_named(body, engine.name)
            return await answer(body)
        except bodies.BadRequest as bad:
            return error(400, str(bad))
        except LookupError as missing:
            return error(404, str(missing))
        except EngineFailed as failed:  # a 500 the client retries or fails over
            return error(500, f"the teacher's engine failed: {failed}")
        except Exception as failed:  # noqa: BLE001 - this server's own fault, after the engine answered
            return error(500, f"serve-teacher failed: {type(failed).__name__}: {failed}")

    async def alive() -> bool:
        """Whether the engine answers (vLLM's health check: its core process up); a dead one stops the server."""
        try:
            await engine.engine.check_health()
        except Exception:  # noqa: BLE001 - a dead engine
            on_engine_death()
            return False
        return True

    @app.get("/health")
    async def health() -> Any:
        return Response(status_code=200 if await alive() else 503)

    @app.get("/metrics")
    async def metrics() -> Any:
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Any:
        if not await alive():  # the card and /health agree: a client's check fails over from a dead engine
            return error(503, "the teacher's engine is dead: this server is stopping (ask another replica)")
        card = {"id": engine.name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": engine.root, "parent": None, "max_model_len": engine.max_model_len,
                CARD_FIELD: card_extension(engine.block_size)}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        async def answer(body: Any) -> Any:
            if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
                raise bodies.BadRequest("this server tokenizes a text: prompt must be a str")
            try:
                tokens = engine.tokenize(body["prompt"], bool(body.get("add_special_tokens", True)))
            except LookupError as none:
                raise bodies.BadRequest(str(none)) from None
            return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
                    "token_strs": None}
        return await answered(request, answer)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        async def answer(body: Any) -> Any:
            asked = bodies.completion(body, engine.vocab_size, engine.max_model_len, engine.max_logprobs)
            ids, first = asked.ids, asked.start or 1  # the first entry with log-probs
            states = await computed(ids, asked.start)
            rows = states[first - 1: len(ids) - 1] if asked.start is None else states[:len(ids) - first]
            entries: list[Any] = [None] * first + prompt_log_prob_entries(rows, engine.head, ids[first:],
                                                                           asked.top_k)
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                      "prompt_logprobs": entries, "prompt_token_ids": None}
            return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                    "model": engine.name, "choices": [choice],
                    "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids), "completion_tokens": 0}}
        return await answered(request, answer)

    @app.post("/pooling")
    async def pooling(request: Request) -> Any:
        async def answer(body: Any) -> Any:
            asked = bodies.pooling(body, engine.vocab_size, engine.max_model_len)
            states = await computed(asked.ids, asked.start)
            first = 0 if asked.start is None else asked.start - 1
            usage = {"prompt_tokens": len(asked.ids), "total_tokens": len(asked.ids)}
            values = states.to(TORCH_DTYPES[asked.embed_dtype]).contiguous()
            if asked.encoding == "bytes":
                content = values.view(torch.uint8).numpy().tobytes() if values.numel() else b""
                item = {"index": 0, "embed_dtype": asked.embed_dtype, "endianness": "little",
                        "shape": list(values.shape), "start": 0, "end": len(content), "first_row": first}
                return Response(content, media_type="application/octet-stream",
                                headers={"metadata": json.dumps({"data": [item], "usage": usage})})
            rows = [[0.0] * values.shape[1]] * first + values.float().tolist()
            return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                    "model": engine.name, "data": [{"index": 0, "object": "pooling", "data": rows}], "usage": usage}
        return await answered(request, answer)

    return app
