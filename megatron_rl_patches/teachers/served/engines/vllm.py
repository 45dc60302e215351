"""A teacher served by vLLM (`VllmEngine`): `/v1/completions` with the sample's ids as `prompt`,
`prompt_logprobs=K`, `max_tokens=1`. Each prompt position p >= 1 answers with the top-k of the
next-token distribution given ids[:p] (ranks 1..K) and the actual id ids[p] when it is outside
them; position 0 is None. vLLM scores prompt log-probs at temperature 1, from the raw logits
(its default `--logprobs-mode raw_logprobs`; `raw_logits` sends logits, which have no tail)."""
from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any

import torch

from megatron_rl_patches.teachers.errors import ServedTeacherError, ServedTeacherRefusal, TokenizerUnavailable
from megatron_rl_patches.teachers.served.engines.names import HEAD_FIX
from megatron_rl_patches.teachers.served.engines.protocol import ROWS, SampleRows, ServedModel
from megatron_rl_patches.teachers.served.engines.vllm_replies import (
    Reply,
    model_cards,
    position_items,
    prompt_positions,
    token_list,
    top_k,
)
from megatron_rl_patches.teachers.served.http import Deadline, TeacherClient
from megatron_rl_patches.teachers.served.rows_check import log_prob_problem
from megatron_rl_patches.teachers.tails import tail_log_probs

# vLLM's words when K is over its --max-logprobs (a 400): "... greater than max allowed: 20"
MAX_LOGPROBS = re.compile(r"greater than max allowed:\s*(-?\d+)")
# vLLM's words when it was started with --skip-tokenizer-init (a 400 from /tokenize)
NO_TOKENIZER = re.compile(r"Tokenizer not available|skip_tokenizer_init")
PROBE_IDS = [0, 0]  # id 0 exists in every vocabulary
# `megatron-rl-patches serve-teacher`'s card field, and the request field telling it where the response
# starts (apps/serve_teacher: the samples of one prompt then share what comes before)
SERVE_TEACHER_CARD = "megatron_rl_patches"
RESPONSE_START = "response_start"
# a router's words when it refuses a token-id prompt (sglang-router 0.3.2 reads `prompt` as text only: a 422)
ROUTER_PROMPT = re.compile(r"StringOrArray")


def shares_prefix(card: dict[str, Any]) -> bool:
    """Whether the model card is `serve-teacher`'s, which shares a group's prefix (its field
    `SERVE_TEACHER_CARD` saying so)."""
    ours = card.get(SERVE_TEACHER_CARD)
    return isinstance(ours, dict) and ours.get("shares_prefix") is True and ours.get("request_field") == RESPONSE_START


def behind_router(url: str, what: str) -> str:
    """The refusal of a router in front of the engine that does not pass what the teacher needs."""
    return (f"{url} {what}: is a router in front of the engine? sglang-router 0.3.2 answers /v1/models with its own "
            f"card (no max_model_len) and passes neither vLLM's token-id prompts (/v1/completions: 422) nor /pooling "
            f"or /tokenize (404); give the engine replicas' own URLs joined by '|' (http://a:8000|http://b:8000;"
            f"engine=vllm): the client spreads the samples over them and survives a dead or slow one")

class VllmEngine:
    """vLLM's OpenAI-compatible server: `/v1/models`, `/v1/completions` with prompt log-probs,
    `/tokenize` (a `ServedEngine` of `kind` ROWS)."""

    kind = ROWS
    path = "/v1/completions"
    tokenize_path = "/tokenize"
    generates = 1  # max_tokens=1: one token after the prompt

    def __init__(self, client: TeacherClient, top_k: int, model: str | None) -> None:
        self.client = client
        self.top_k = top_k
        self.model = model

    # ------------------------------------------------------------------ the server, asked once
    def served_model(self, deadline: Deadline, cancel: threading.Event) -> ServedModel:
        """The model at the URL (`/v1/models`; the one named `model` when several are served),
        checked by one tiny scoring request: K within `--max-logprobs`, log-probs not logits."""
        listing = self.client.request("GET", "/v1/models", None, deadline, cancel)
        cards = model_cards(listing, Reply(f"{self.client.url}/v1/models", self.client.url, None))
        names = [name for name, _, _ in cards]
        if self.model is None and len(cards) > 1:
            raise ServedTeacherRefusal(f"{self.client.url} serves {len(cards)} models {names}: name one with "
                                       f"ServedTeacher(model=...)", self.client.url)
        if self.model is not None and self.model not in names:
            raise ServedTeacherRefusal(f"{self.client.url} does not serve model={self.model!r}: it serves {names}",
                                       self.client.url)
        name, length, root = cards[0] if self.model is None else cards[names.index(self.model)]
        if isinstance(length, bool) or not isinstance(length, int) or length < 2:
            raise ServedTeacherError(behind_router(self.client.url, f"/v1/models gives no max_model_len for {name!r}, "
                                                   f"as vLLM's own server does"), self.client.url)
        card = listing["data"][names.index(name)]
        model = ServedModel(name, length, root, self.generates, shares_prefix=shares_prefix(card))
        answer = self.probe(model, deadline, cancel)
        self.check_card(card)
        return dataclasses.replace(model, answer=answer)

    def check_card(self, card: dict[str, Any]) -> None:
        """What else the engine compares with the served model's card (`/v1/models`): nothing
        here (the pooling engine: the checkpoint it serves against the head's)."""

    def probe(self, model: ServedModel, deadline: Deadline, cancel: threading.Event) -> SampleRows:
        """One tiny scoring request: K within `--max-logprobs`, log-probs not logits; its rows are
        what the server computes for the fixed probe."""
        return self.ask(model, PROBE_IDS, 1, deadline, cancel, sample=None)

    def tokenize(self, model: ServedModel, text: str, deadline: Deadline, cancel: threading.Event) -> list[int] | None:
        """`text` tokenized by the served model's tokenizer (`/tokenize`, no special tokens added)."""
        try:
            reply = self.client.request("POST", self.tokenize_path, {"model": model.name, "prompt": text,
                                                                       "add_special_tokens": False}, deadline, cancel)
        except ServedTeacherRefusal as refused:
            if NO_TOKENIZER.search(str(refused)) is None:
                raise
            raise TokenizerUnavailable(f"{self.client.url}{self.tokenize_path}: the server has no tokenizer (started "
                                       f"with --skip-tokenizer-init; it said: {refused})", self.client.url) from None
        return token_list(reply, Reply(f"{self.client.url}{self.tokenize_path}", self.client.url, None))

    # ------------------------------------------------------------------ one sample
    def body(self, model: ServedModel, ids: list[int], start: int) -> dict[str, Any]:
        """The request of rows start..len(ids)-1; to a server that shares a group's prefix, with
        where the response starts (vLLM's own server is sent its stock body)."""
        body = {"model": model.name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": self.top_k,
                "temperature": 1.0, "detokenize": False}
        return {**body, RESPONSE_START: start} if model.shares_prefix else body

    def ask(self, model: ServedModel, ids: list[int], start: int, deadline: Deadline,
            cancel: threading.Event, sample: int | None) -> SampleRows:
        """Rows start..len(ids)-1 of one sample, scored by the server."""
        try:
            reply = self.client.request("POST", self.path, self.body(model, ids, start), deadline, cancel, sample)
        except ServedTeacherRefusal as refused:
            found = MAX_LOGPROBS.search(str(refused))
            if found is None and ROUTER_PROMPT.search(str(refused)):
                raise ServedTeacherRefusal(behind_router(self.client.url, f"refuses a prompt of token ids ({refused})"),
                                           self.client.url, sample) from None
            if found is None and "HTTP 404" in str(refused):  # a pooling server has no /v1/completions
                raise ServedTeacherRefusal(f"{self.client.url} does not serve {self.path} (HTTP 404): a pooling server "
                                           f"(--runner pooling) sends hidden states, not prompt log-probs; {HEAD_FIX}, "
                                           f"or serve the teacher without --runner pooling", self.client.url,
                                           sample) from None
            if found is None:
                raise
            limit = int(found.group(1))
            raise ServedTeacherRefusal(f"top_k={self.top_k} is over the server's --max-logprobs {limit} at "
                                       f"{self.client.url}: ask for top_k <= {limit}, or serve the teacher with "
                                       f"--max-logprobs {self.top_k}", self.client.url, sample) from None
        return self.parse(reply, ids, start, sample)

    def parse(self, reply: Any, ids: list[int], start: int, sample: int | None) -> SampleRows:
        """The reply's prompt log-probs as `SampleRows` (the top-k best first), read against
        their expected shape (`vllm_replies`)."""
        where = f"{self.client.url}{self.path}" + ("" if sample is None else f" (sample {sample})")
        said = Reply(where, self.client.url, sample)
        positions = prompt_positions(reply, len(ids), said)
        k = self.top_k
        rows = len(ids) - start
        token = [0.0] * rows
        top_ids: list[int] = []
        top_values: list[float] = []
        for r in range(rows):
            actual = ids[start + r]
            items = position_items(positions[start + r], start + r, actual, k, said)
            token[r] = next(value for i, value, _ in items if i == actual)
            for i, value in top_k(items, actual, k):
                top_ids.append(i)
                top_values.append(value)
        values = torch.tensor(top_values, dtype=torch.float64).reshape(rows, k)
        token_values = torch.tensor(token, dtype=torch.float64)
        self.check_log_probs(values, token_values, where, sample)
        return SampleRows(token_values, torch.tensor(top_ids, dtype=torch.int64).reshape(rows, k), values,
                          tail_log_probs(values))

    def check_log_probs(self, values: torch.Tensor, token: torch.Tensor, where: str, sample: int | None) -> None:
        """Log-probabilities, not logits: each <= 0 and the top-k mass <= 1 (within fp32 slack;
        `rows_check`, which given rows pass too)."""
        bad = log_prob_problem(values, token)
        if bad is not None:
            raise ServedTeacherError(f"{where}: the server's prompt_logprobs are no log-probabilities ({bad}): serve "
                                     f"the teacher with vLLM's default --logprobs-mode raw_logprobs (raw_logits has "
                                     f"no tail)", self.client.url, sample)
