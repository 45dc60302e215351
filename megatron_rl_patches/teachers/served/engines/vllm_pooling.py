"""A teacher's final hidden states from vLLM's pooling runner (`VllmPoolingEngine`): `/pooling` with
the sample's ids as `input`, `task: token_embed`, `use_activation: false` answers a causal LM's
final (normed) hidden state at every position, [T, H]; the state at position p predicts token
p + 1. The reply is binary (`encoding_format: bytes`): the rows as `embed_dtype` values, their
shape, dtype and byte range in the `metadata` header (vLLM 0.32, `entrypoints/pooling/utils.py`);
only the response's rows are decoded. The server is started with `--runner pooling --convert
embed --pooler-config '{"task": "token_embed"}'`; it never forms [T, V]."""
from __future__ import annotations

import sys
import threading
from typing import Any, TypeGuard

import torch

from megatron_rl_patches.inference.loading.json_read import parsed_json
from megatron_rl_patches.teachers.errors import ServedTeacherError, ServedTeacherRefusal
from megatron_rl_patches.teachers.served.engines.protocol import STATES, ServedModel
from megatron_rl_patches.teachers.served.engines.vllm import PROBE_IDS, RESPONSE_START, VllmEngine
from megatron_rl_patches.teachers.served.http import Deadline, TeacherClient
from megatron_rl_patches.teachers.served.rows_check import first_non_finite_row

SERVE_POOLING = "--runner pooling --convert embed --pooler-config '{\"task\": \"token_embed\"}'"
# the values a pooling reply travels as (vLLM's embed_dtype names, vllm/utils/serial_utils.py): the
# first three lossless for a model of that dtype; fp8 one byte a value (the server casts with torch:
# e4m3fn saturates at +-448, e5m2 overflows to an infinity, refused below)
EMBED_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


class VllmPoolingEngine(VllmEngine):
    """vLLM's pooling server: `/v1/models`, `/pooling` (hidden states), `/tokenize`. Built with the
    head's `hidden_size` (checked against the server at connect) and the `dtype` the states
    travel in (the served model's: bf16 round-trips exactly); of `kind` STATES."""

    kind = STATES
    path = "/pooling"
    generates = 0  # a pooling request generates nothing: a sample may fill the max model length

    def __init__(self, client: TeacherClient, top_k: int, model: str | None, hidden_size: int = 0,
                 dtype: torch.dtype = torch.float32, head_source: str = "", head_fingerprint: str = "") -> None:
        super().__init__(client, top_k, model)
        self.head_source, self.head_fingerprint = head_source, head_fingerprint
        if not isinstance(dtype, torch.dtype) or dtype not in EMBED_DTYPES:  # a list: no bare "unhashable type"
            raise ValueError(f"ServedTeacher(hidden_dtype=...) must be one of {[str(d) for d in EMBED_DTYPES]} (the "
                             f"served model's dtype, in which its hidden states travel), got {dtype!r}")
        self.hidden_size = hidden_size
        self.dtype = dtype

    def check_card(self, card: dict[str, Any]) -> None:
        """The checkpoint the server serves (its card's `root`, the path it was started with) is the
        head's, where both are directories on this machine (`engines/checkpoint.py`)."""
        from megatron_rl_patches.teachers.served.engines.checkpoint import check_served_checkpoint  # lazy: import cost

        check_served_checkpoint(card.get("root"), self.head_source, self.head_fingerprint, self.client.url)

    def probe(self, model: ServedModel, deadline: Deadline,  # type: ignore[override]
              cancel: threading.Event) -> torch.Tensor:
        """One tiny request: the server runs the pooling task and its states have the head's width
        (they are what it computes for the fixed probe)."""
        return self.ask(model, PROBE_IDS, 1, deadline, cancel, sample=None)

    def body(self, model: ServedModel, ids: list[int], start: int) -> dict[str, Any]:
        body = {"model": model.name, "input": ids, "task": "token_embed", "use_activation": False,
                "encoding_format": "bytes", "embed_dtype": EMBED_DTYPES[self.dtype], "endianness": "little",
                "add_special_tokens": False}
        return {**body, RESPONSE_START: start} if model.shares_prefix else body

    def ask(self, model: ServedModel, ids: list[int], start: int, deadline: Deadline,  # type: ignore[override]
            cancel: threading.Event, sample: int | None) -> torch.Tensor:
        """[R, H] in the dtype asked: row r the state that predicts token start + r (positions
        start - 1 ... len(ids) - 2 of the reply; no other row is decoded)."""
        try:
            reply = self.client.request("POST", self.path, self.body(model, ids, start), deadline, cancel, sample,
                                        raw=True)
        except ServedTeacherRefusal as refused:
            raise self.reworded(refused, sample) from None
        return self.rows(reply, len(ids), start, sample)

    def reworded(self, refused: ServedTeacherRefusal, sample: int | None) -> ServedTeacherRefusal:
        """A refusal that names what to serve: a server without /pooling (a generate server) or
        one whose pooler is not token_embed."""
        said = str(refused)
        if "HTTP 404" in said:
            return ServedTeacherRefusal(f"{self.client.url} does not serve {self.path} (HTTP 404): hidden states need "
                                        f"vLLM's pooling runner; serve the teacher with {SERVE_POOLING}",
                                        self.client.url, sample)
        if "task" in said and "pooler" in said:
            return ServedTeacherRefusal(f"{self.client.url} does not pool per token ({said}): serve the teacher with "
                                        f"{SERVE_POOLING}", self.client.url, sample)
        return refused

    def rows(self, reply: Any, length: int, start: int, sample: int | None) -> torch.Tensor:
        """The response's rows of a binary pooling reply, checked against the request."""
        where = f"{self.client.url}{self.path}" + ("" if sample is None else f" (sample {sample})")
        item = metadata_item(reply, where, self.client.url, sample)
        shape, asked = item.get("shape"), EMBED_DTYPES[self.dtype]
        width = self.hidden_size or (shape[1] if isinstance(shape, list) and len(shape) == 2 else 0)

        def refuse(problem: str) -> ServedTeacherError:
            return ServedTeacherError(f"{where}: {problem}", self.client.url, sample)

        if item.get("embed_dtype") != asked:
            raise refuse(f"the hidden states came as {item.get('embed_dtype')!r}, not the {asked!r} asked")
        order = item.get("endianness")
        if order != "little" and not (order == "native" and sys.byteorder == "little"):
            raise refuse(f"the hidden states came {item.get('endianness')!r}-endian, not little-endian as asked")
        if not isinstance(shape, list) or len(shape) != 2 or not all(is_count(n) for n in shape):
            raise refuse(f"the reply's shape {shape!r:.80} is no [rows, width] of ints")
        # serve-teacher, told where the response starts, sends the rows from start - 1 on (`first_row`)
        offset = item.get("first_row", 0)
        if not is_count(offset) or offset > start - 1:
            raise refuse(f"the reply's first_row {offset!r:.40} is past the response's first row {start - 1}")
        length -= offset
        start -= offset
        if shape[0] != length:
            raise refuse(f"{length + offset} ids sent but hidden states of shape {shape} came back from row {offset} "
                         f"(one row per id expected)")
        if shape[1] != width:  # another model than the head's: a refusal (fix the configuration), not a failure
            raise ServedTeacherRefusal(f"{where}: hidden states of width {shape[1]} came back, but the teacher's head "
                                       f"has hidden size {width}: the server serves another model than the head's "
                                       f"checkpoint", self.client.url, sample)
        size = torch.tensor([], dtype=self.dtype).element_size()
        first, end, content = item.get("start"), item.get("end"), reply.content
        # the range read against the body before anything is read: a negative start would slice from the end
        if not (is_count(first) and is_count(end) and end == first + length * width * size <= len(content)):
            raise refuse(f"the reply's bytes [{first!r:.40}, {end!r:.40}) of {len(content)} do not hold {length} x "
                         f"{width} {asked} values")
        row_bytes = width * size
        needed = bytearray(content[first + (start - 1) * row_bytes: first + (length - 1) * row_bytes])
        states = torch.frombuffer(needed, dtype=self.dtype).reshape(length - start, width) if needed \
            else torch.zeros(0, width, dtype=self.dtype)
        bad = first_non_finite_row(states)  # one sum first: 8x less time on large replies (`rows_check`)
        if bad is not None:
            raise refuse(f"the hidden state of row {bad} (position {offset + start - 1 + bad}) is not finite")
        return states


def is_count(value: object) -> TypeGuard[int]:
    """A non-negative int as JSON writes one (no bool, no float)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def metadata_item(reply: Any, where: str, url: str, sample: int | None) -> dict[str, Any]:
    """The one item of a binary pooling reply's `metadata` header (one input per request)."""
    header = reply.headers.get("metadata")
    parsed = None if header is None else parsed_json(header, lambda problem: ServedTeacherError(
        f"{where}: the reply's metadata header {problem}", url, sample))
    items = parsed.get("data") if isinstance(parsed, dict) else None
    if not isinstance(items, list) or len(items) != 1 or not isinstance(items[0], dict):
        raise ServedTeacherError(f"{where}: the reply has no binary pooling metadata for one input (header "
                                 f"'metadata': {str(header)[:200]!r}); is this a vLLM pooling server (vLLM >= 0.32)?",
                                 url, sample)
    return items[0]
