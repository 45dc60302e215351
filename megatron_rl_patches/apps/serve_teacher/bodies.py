"""The request bodies `serve-teacher` takes, read into what the engine is asked (`Scoring`): vLLM's
`/v1/completions` with `prompt_logprobs` and `/pooling` with `task: token_embed`, as `ServedTeacher`
sends them, plus the field `response_start` (this server's card names it): rows from the response
start - 1 on only, so the samples of a group share what comes before. Anything else is a
`BadRequest` (HTTP 400) whose words name the body or the field, in vLLM's words where the client
reads them: every request the engine never runs is the client's mistake, never the engine failing
(a 500, which the client retries and fails over on). Standard library only."""
from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.inference.loading.json_read import parsed_json

RESPONSE_START = "response_start"
POOLING_FORMATS = ("float", "bytes")
EMBED_DTYPES = ("float32", "bfloat16", "float16")


class BadRequest(ValueError):
    """A request this server refuses (HTTP 400), in words naming the field."""


@dataclass(frozen=True)
class LongInteger:
    """A JSON integer of more `digits` than Python reads (`sys.get_int_max_str_digits()`), kept in
    the body for the field that holds it to name (json's own error names neither)."""

    digits: int


def kept_integer(text: str) -> int | LongInteger:
    """json's `parse_int`: `text` as an int, or a `LongInteger` where Python refuses its length."""
    try:
        return int(text)
    except ValueError:
        return LongInteger(len(text.lstrip("-")))


def read_body(raw: bytes) -> Any:
    """The request's JSON as json reads it (vLLM's server: the same); a `BadRequest` naming the body
    where it is none (`parsed_json`: nested past the recursion limit, no UTF-8, malformed). An
    integer too long for Python is read again as a `LongInteger` for its field to name."""
    try:
        return json.loads(raw)  # every int through the C scanner: a parse_int hook costs 3x on a prompt's ids
    except (ValueError, RecursionError):
        pass
    return parsed_json(raw, lambda problem: BadRequest(f"the body {problem}"),
                       functools.partial(json.loads, parse_int=kept_integer))


def long_integer(value: Any, field: str) -> None:
    """A `BadRequest` naming `field` where `value` is an integer Python did not read."""
    if isinstance(value, LongInteger):
        raise BadRequest(f"{field} is an integer of {value.digits:,} digits, past the "
                         f"{sys.get_int_max_str_digits():,} digits a JSON integer may have here (Python's int limit)")


def served_model_named(body: dict[str, Any], name: str) -> None:
    """`body`'s `model` (None or left out: the served one): a `BadRequest` where it is no str, a
    LookupError (HTTP 404, vLLM's words) where it names another model."""
    named = body.get("model")
    if named is None:
        return
    if not isinstance(named, str):
        raise BadRequest(f"model must be the served model's name (a str), got a {type(named).__name__}")
    if named != name:
        shown = named if len(named) <= 60 else named[:60] + "…"
        raise LookupError(f"The model `{shown}` does not exist.")


@dataclass(frozen=True)
class Scoring:
    """One sample to compute: its `ids`; `start` (None: every row, as vLLM's server answers; an int:
    the rows from `start` - 1 on, the rows before left out); `top_k` (prompt log-probs) or the
    pooling reply's `encoding` and `embed_dtype`."""

    ids: list[int]
    start: int | None
    top_k: int = 0
    encoding: str = "bytes"
    embed_dtype: str = "float32"


def token_ids(value: Any, field: str, vocab_size: int, max_model_len: int) -> list[int]:
    if isinstance(value, list):
        for at, one in enumerate(value):
            long_integer(one, f"{field}[{at}]")
    if not isinstance(value, list) or not value or \
            not all(isinstance(one, int) and not isinstance(one, bool) for one in value):
        raise BadRequest(f"{field} must be a non-empty list of token ids (this server takes token ids, not text)")
    if min(value) < 0 or max(value) >= vocab_size:
        raise BadRequest(f"{field} holds an id outside the model's vocabulary of {vocab_size}")
    if len(value) > max_model_len:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                         f"{len(value)} input tokens: a sample and its shared prefix must fit --max-model-len")
    return value


def response_start(body: dict[str, Any], length: int) -> int | None:
    start = body.get(RESPONSE_START)
    if start is None:
        return None
    long_integer(start, RESPONSE_START)
    if isinstance(start, bool) or not isinstance(start, int) or not 1 <= start < length:
        raise BadRequest(f"{RESPONSE_START} must be an int from 1 to the prompt's length - 1 ({length - 1}), the "
                         f"first response id's position, got {start!r:.40}")
    return start


def logprobs_limit(max_logprobs: int, vocab_size: int) -> int:
    """The largest `prompt_logprobs` answered: `--max-logprobs`, the vocabulary where it is -1 (as
    vLLM reads it) or larger (no row holds more ids than the vocabulary)."""
    return vocab_size if max_logprobs < 0 else min(max_logprobs, vocab_size)


def completion(body: Any, vocab_size: int, max_model_len: int, max_logprobs: int) -> Scoring:
    """A `/v1/completions` body: `prompt` (token ids) and `prompt_logprobs` K."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("prompt_logprobs are not available when stream is enabled")
    ids = token_ids(body.get("prompt"), "prompt", vocab_size, max_model_len)
    k = body.get("prompt_logprobs")
    long_integer(k, "prompt_logprobs")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise BadRequest("this server answers prompt log-probs only: prompt_logprobs must be an int >= 0 (the top-k "
                         "per position)")
    limit = logprobs_limit(max_logprobs, vocab_size)
    if k > limit:  # vLLM's words: the client reads the limit from them
        raise BadRequest(f"Requested prompt logprobs of {k}, which is greater than max allowed: {limit}")
    return Scoring(ids, response_start(body, len(ids)), top_k=k)


def pooling(body: Any, vocab_size: int, max_model_len: int) -> Scoring:
    """A `/pooling` body: `input` (token ids), `task: token_embed`, no activation."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if body.get("task", "token_embed") != "token_embed":
        raise BadRequest(f"this server pools per token only (task 'token_embed'), not task {body.get('task')!r:.40}")
    if body.get("use_activation", False) or body.get("normalize", False):
        raise BadRequest("this server sends the final hidden states as they are: use_activation must be false")
    ids = token_ids(body.get("input"), "input", vocab_size, max_model_len)
    encoding = body.get("encoding_format", "float")
    if encoding not in POOLING_FORMATS:
        raise BadRequest(f"encoding_format must be one of {list(POOLING_FORMATS)}, got {encoding!r:.40}")
    dtype = body.get("embed_dtype", "float32")
    if dtype not in EMBED_DTYPES:
        raise BadRequest(f"embed_dtype must be one of {list(EMBED_DTYPES)}, got {dtype!r:.40}")
    if body.get("endianness", "native") not in ("native", "little"):
        raise BadRequest("this server sends little-endian values only: endianness must be 'little' or 'native'")
    return Scoring(ids, response_start(body, len(ids)), encoding=encoding, embed_dtype=dtype)
