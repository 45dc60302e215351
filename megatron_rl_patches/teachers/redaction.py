"""What errors, logs and `doctor` may show of a URL, a teacher entry or a setting of several
(`redacted`), whether one carries a user or password (`has_userinfo`, `refuse_userinfo`), and a
served teacher's API key taken out of what a server said (`without_key`) and out of every message
the served client builds, whatever the reply's status (`scrubbed`: the live keys, read from the
variables the clients read them from). URLs are read on the raw text, before
anything splits or parses it: a password may hold what splits a setting or an entry (',' between
entries, '|' between replicas, ';' before options, white space around them) or ends a parsed
authority early ('/', '#', '@'). Standard library only (and the leaf `settings`).

Where a URL's user or password ends: after '://' comes either a plain authority (host[:port],
then the end of the text or one of the characters that end it) or not. A plain authority holds
no user; an '@' after it is a password's only where it is not in an option's value (`;head=DIR`
may name a path holding '@') and a host follows it — so a password of digits before a
separator (`bob:1234,5678@host`) is still found. Anything else before an '@' is a user or
password up to the last '@' a host follows (or the last '@') before the next URL whose authority
is plain. Redacting more than the password is harmless; showing a piece of it is not.

The key's rule: no message holds `KEY_PIECE` (8) characters of the key in a row, nor the whole of a
shorter key, as written or escaped (JSON, repr). A server may cut or split what it quotes, and the
client cuts the fields it quotes (30 to 200 characters): every piece of 8 or more is hidden wherever
it stands, so a cut shows at most 7 characters of the key at the cut."""
from __future__ import annotations

import json
import re
from typing import Any

from megatron_rl_patches.settings import TEACHER_API_KEY, api_key

SCHEME_END = "://"
HIDDEN = "***"
# what ends an authority: a path, a query, a fragment, an option, another entry or replica, white space
AUTHORITY_END = "/?#;,|"
HOST = r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~%-]+)(?::[0-9]*)?"
PLAIN_AUTHORITY = re.compile(HOST + rf"(?=$|[{re.escape(AUTHORITY_END)}\s])")
OPTION_VALUE = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*=")  # `name=` after a ';': an option's value
AT = re.compile("@")
BEARER = re.compile(r"(?i)(\bbearer\s+)\S+")
KEY_PIECE = 8  # a piece of the API key this long is hidden wherever a server quotes it
# the environment variables a served teacher's API key is read from: the default one, and each
# `ClientSettings(api_key_env=...)` a client was built with (`key_variable`)
KEY_VARIABLES = {TEACHER_API_KEY}


QUOTED = 300  # characters of an entry, an option or a setting's value a message quotes


def quoted(text: str, limit: int = QUOTED) -> str:
    """`text` as a message quotes it: its repr, cut past `limit` characters to its first `limit` and
    its length (a pasted megabyte must not make a megabyte message)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"


def userinfo_spans(text: str) -> list[tuple[int, int]]:
    """(just after '://', its user's '@') for every URL in `text` that carries a user or password."""
    starts = [match.end() for match in re.finditer(re.escape(SCHEME_END), text)]
    plain = [PLAIN_AUTHORITY.match(text, start) is not None for start in starts]
    spans, i = [], 0
    while i < len(starts):
        start = starts[i]
        if plain[i]:  # host[:port] and its end: an '@' after it is a password's only outside option values
            region_end = starts[i + 1] - len(SCHEME_END) if i + 1 < len(starts) else len(text)
            ats = [at for at in ats_before_a_host(text, start, region_end) if not in_option(text, start, at)]
        else:  # anything else up to the next URL whose authority is plain
            following = next((j for j in range(i + 1, len(starts)) if plain[j]), len(starts))
            region_end = starts[following] - len(SCHEME_END) if following < len(starts) else len(text)
            ats = ats_before_a_host(text, start, region_end) or \
                [at.start() for at in AT.finditer(text, start, region_end)]
        if ats:
            spans.append((start, ats[-1]))
            while i < len(starts) and starts[i] <= ats[-1]:  # a '://' inside the password is the password's
                i += 1
        else:
            i += 1
    return spans


def ats_before_a_host(text: str, start: int, end: int) -> list[int]:
    """The '@'s in text[start:end] that a plain authority (host[:port], then its end) follows."""
    return [at.start() for at in AT.finditer(text, start, end) if PLAIN_AUTHORITY.match(text, at.start() + 1)]


def in_option(text: str, start: int, at: int) -> bool:
    """Whether the '@' at `at` is in an option's value: `;name=` before it, after the URL's start."""
    semicolon = text.rfind(";", start, at)
    return semicolon >= 0 and OPTION_VALUE.match(text, semicolon + 1) is not None


def redacted(text: str) -> str:
    """`text` with every URL's user and password (from '://' to its user's '@') replaced by '***'."""
    pieces, done = [], 0
    for start, at in userinfo_spans(text):
        pieces += [text[done:start], HIDDEN]
        done = at
    return "".join(pieces) + text[done:]


def has_userinfo(text: str) -> bool:
    """Whether a URL in `text` carries a user or password."""
    return bool(userinfo_spans(text))


def refuse_userinfo(text: str, where: str) -> None:
    """A ValueError naming `where` (the setting, argument or entry `text` came in) when a URL in
    `text` carries a user or password: called on the raw text, before anything splits it."""
    if has_userinfo(text):
        raise ValueError(f"{where}: {redacted(text)!r} carries a user or password in a URL ('user:pass@'), which "
                         f"would be printed wherever it is (doctor, logs): drop it and put the API key in "
                         f"{TEACHER_API_KEY} (sent as a bearer token)")


def without_key(text: str, key: str | None) -> str:
    """What a server said, without the API key: every piece of `key` of 8 characters or more (or
    the whole of a shorter key; a server may cut what it quotes) and the value of every
    `Bearer <value>` replaced by '***', before the text is quoted or cut."""
    return key_hidden(BEARER.sub(lambda match: match.group(1) + HIDDEN, text), key)


def key_variable(name: str) -> None:
    """Note `name` as a variable an API key is read from: its value is hidden by `scrubbed`."""
    KEY_VARIABLES.add(name)


def live_keys() -> list[str]:
    """The API keys the environment holds now, in every variable a client reads one from."""
    return [key for key in (api_key(name) for name in sorted(KEY_VARIABLES)) if key]


def scrubbed(text: str) -> str:
    """`text` without any piece of a live API key (`live_keys`; the module's rule): every message
    the served client builds (`ServedTeacherError`), every line `doctor` shows."""
    for key in live_keys():
        text = key_hidden(text, key)
    return text


def scrubbed_all(value: Any) -> Any:
    """`value` (str, or dicts and lists of them: a JSON-ready report) with every str `scrubbed`."""
    if isinstance(value, str):
        return scrubbed(value)
    if isinstance(value, dict):
        return {scrubbed_all(name): scrubbed_all(item) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(scrubbed_all(item) for item in value)
    return value


def key_hidden(text: str, key: str | None) -> str:
    """`text` with every piece of `key` (as written, JSON- or repr-escaped) of `KEY_PIECE`
    characters or more, or the whole of a shorter key, replaced by '***'."""
    if not key:
        return text
    for written in dict.fromkeys((key, json.dumps(key)[1:-1], repr(key)[1:-1])):
        text = pieces_hidden(text, written)
    return text


def pieces_hidden(text: str, key: str) -> str:
    """`text` with every piece of `key` of `KEY_PIECE` characters or more (the whole of a shorter
    key) replaced by '***', each as long as it goes on."""
    shortest = min(len(key), KEY_PIECE)
    windows = {key[i:i + shortest] for i in range(len(key) - shortest + 1)}
    pieces, done, i = [], 0, 0
    while i <= len(text) - shortest:
        if text[i:i + shortest] not in windows:
            i += 1
            continue
        end = i + shortest
        while end < len(text) and text[i:end + 1] in key:  # the piece as long as it goes on
            end += 1
        pieces += [text[done:i], HIDDEN]
        done = i = end
    return "".join(pieces) + text[done:]
