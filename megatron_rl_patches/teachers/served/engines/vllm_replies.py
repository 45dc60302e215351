"""vLLM's replies read against their expected shape, in one place: the model cards of `/v1/models`,
the prompt log-probs of `/v1/completions` and the tokens of `/tokenize`. Whatever else a server
sends (a card that is no object, an entry without `rank` or `logprob`, an id that is no canonical
non-negative int64 — so no two keys of a row name one id —, a string log-prob, a float rank) is a
`ServedTeacherError` naming the URL, the sample and the field, never a bare Python error.
Values decide the order of a row's top-k: ranks that contradict them are not followed."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.teachers.errors import ServedTeacherError

INT64_MAX = 2**63 - 1
CANONICAL_ID = re.compile(r"(0|[1-9][0-9]*)")  # what vLLM writes: no sign, no leading zero, no space


@dataclass(frozen=True)
class Reply:
    """Where a reply came from, for its errors: `where` (URL and route, and the sample), `url`,
    `sample`."""

    where: str
    url: str
    sample: int | None

    def bad(self, field: str, what: str) -> ServedTeacherError:
        return ServedTeacherError(f"{self.where}: the reply's {field} {what}", self.url, self.sample)


def model_cards(reply: Any, said: Reply) -> list[tuple[str, Any, str | None]]:
    """(id, max_model_len as sent, root: a str or None) of every card of a `/v1/models` reply."""
    cards = reply.get("data") if isinstance(reply, dict) else None
    if not isinstance(cards, list) or not cards:
        raise ServedTeacherError(f"{said.where} lists no model: is this a vLLM server?", said.url)
    found = []
    for i, card in enumerate(cards):
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            raise said.bad(f"data[{i}]", f"is no model card with a str id (got {card!r:.60}): is this a vLLM "
                                         f"server?")
        root = card.get("root")
        found.append((card["id"], card.get("max_model_len"), root if isinstance(root, str) else None))
    return found


def token_list(reply: Any, said: Reply) -> list[int] | None:
    """The `tokens` of a `/tokenize` reply (None where there is no list); ids checked as ints."""
    tokens = reply.get("tokens") if isinstance(reply, dict) else None
    if not isinstance(tokens, list):
        return None
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT64_MAX:
            raise said.bad(f"tokens[{i}]", f"is no token id (got {token!r:.40})")
    return tokens


def prompt_positions(reply: Any, count: int, said: Reply) -> list[Any]:
    """`choices[0].prompt_logprobs` of a `/v1/completions` reply: one entry per prompt id."""
    try:
        positions = reply["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ServedTeacherError(f"{said.where}: the reply has no choices[0].prompt_logprobs", said.url,
                                 said.sample) from None
    if not isinstance(positions, list) or len(positions) != count:
        got = len(positions) if isinstance(positions, list) else type(positions).__name__
        raise ServedTeacherError(f"{said.where}: {count} prompt ids but prompt_logprobs of length {got}", said.url,
                                 said.sample)
    return positions


def position_items(entry: Any, position: int, actual: int, k: int, said: Reply) -> list[tuple[int, float, int]]:
    """One position's (id, log-prob, rank) items, each checked; the actual id among them and
    k or k + 1 items (vLLM's top-k, with the actual id beside them when outside)."""
    field = f"prompt_logprobs[{position}]"
    if not isinstance(entry, dict) or str(actual) not in entry or len(entry) not in (k, k + 1):
        raise ServedTeacherError(f"{said.where}: position {position} holds no top-{k} with the actual id {actual} "
                                 f"(got {type(entry).__name__} of {len(entry) if isinstance(entry, dict) else 0} "
                                 f"entries)", said.url, said.sample)
    items = []
    for key, item in entry.items():
        # the common case checked in a few cheap tests; anything else named by `bad_item`
        if not (key.isdigit() and key.isascii() and (key[0] != "0" or key == "0") and len(key) < 19
                and type(item) is dict):
            raise bad_item(field, key, item, said)
        value, rank = item.get("logprob"), item.get("rank")
        if not (type(value) is float or type(value) is int) or value != value or type(rank) is not int or rank < 1:
            raise bad_item(field, key, item, said)
        items.append((int(key), float(value), rank))
    return items  # the keys are one dict's: canonical ids are distinct ids


def bad_item(field: str, key: Any, item: Any, said: Reply) -> ServedTeacherError:
    """What is wrong with one item of a position (a key that is no id, or an item that is no
    object with a number `logprob` and an int `rank` >= 1)."""
    where = f"{field}[{key!r:.30}]"
    if not isinstance(key, str) or CANONICAL_ID.fullmatch(key) is None:
        what = "is a negative id" if isinstance(key, str) and key.strip().startswith("-") else \
            "is no token id written plainly (a sign, a leading zero or white space would let two keys name one id)"
        return said.bad(f"{field} key {key!r:.30}", what)
    if int(key) > INT64_MAX:
        return said.bad(f"{field} key {key:.30}", "is past int64")
    if not isinstance(item, dict):
        return said.bad(where, f"is no object with logprob and rank (got {type(item).__name__})")
    value, rank = item.get("logprob"), item.get("rank")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return said.bad(f"{where}.logprob", f"is no number (got {value!r:.40})")
    return said.bad(f"{where}.rank", f"is no rank, an int >= 1 (got {rank!r:.40})")


def top_k(items: list[tuple[int, float, int]], actual: int, k: int) -> list[tuple[int, float]]:
    """The position's top-k (id, log-prob), best first: with k + 1 items the actual id is the one
    outside them; the values decide the order (ties by rank, then id), whatever the ranks say."""
    chosen = [item for item in items if item[0] != actual] if len(items) > k else items
    chosen.sort(key=lambda item: (-item[1], item[2], item[0]))
    return [(token, value) for token, value, _ in chosen]
