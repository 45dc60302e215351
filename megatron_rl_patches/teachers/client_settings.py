"""How a served teacher's HTTP client behaves (`ClientSettings`): timeouts, the step's deadline,
retries, what is in flight at once, the API key's variable and the CAs TLS is verified against.
Standard library only."""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, fields

from megatron_rl_patches._args import positive_int
from megatron_rl_patches._variables import TEACHER_API_KEY
from megatron_rl_patches.teachers.finite import shown, utf8_text, wait_seconds

API_KEY_ENV = TEACHER_API_KEY


@dataclass(frozen=True)
class ClientSettings:
    """`timeout_s`: one request's read / write limit; `connect_timeout_s`: opening a connection;
    `deadline_s`: a whole step (every sample of one `score`), after which it fails naming the URL
    and a sample; `retries` (with `backoff_s` doubling, at most 8 s) on connection errors and 5xx
    only; `max_in_flight` requests and `max_tokens_in_flight` prompt tokens at once (the server
    holds [tokens, vocabulary] log-probs for each; a longer sample goes alone); the API key is read
    from the variable `api_key_env` (sent as a bearer token, never part of the URL); TLS is
    verified against `ca_bundle` (a PEM file) or else the system's CAs."""

    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    deadline_s: float = 900.0
    retries: int = 3
    backoff_s: float = 0.5
    max_in_flight: int = 16
    max_tokens_in_flight: int = 65536
    api_key_env: str = API_KEY_ENV
    ca_bundle: str | None = None

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s", "deadline_s"):
            seconds(f"ClientSettings({name}=...)", getattr(self, name), allow_zero=False)
        seconds("ClientSettings(backoff_s=...)", self.backoff_s, allow_zero=True)
        if isinstance(self.retries, bool) or not isinstance(self.retries, numbers.Integral) or self.retries < 0:
            raise ValueError(f"ClientSettings(retries=...) must be an int >= 0, got {shown(self.retries)}")
        positive_int("ClientSettings(max_in_flight=...)", self.max_in_flight, " (requests at once)")
        positive_int("ClientSettings(max_tokens_in_flight=...)", self.max_tokens_in_flight, " (prompt tokens at once)")
        if not isinstance(self.api_key_env, str) or not self.api_key_env:
            raise ValueError(f"ClientSettings(api_key_env=...) must name an environment variable, got "
                             f"{self.api_key_env!r}")
        utf8_text(self.api_key_env, "ClientSettings(api_key_env=...)")
        if "=" in self.api_key_env or "\0" in self.api_key_env:
            held = "NUL" if "\0" in self.api_key_env else "'='"
            raise ValueError(f"ClientSettings(api_key_env=...) holds {held} ({self.api_key_env!r}), which no "
                             "environment variable's name holds: name the variable the API key is in")
        if self.ca_bundle is not None and not os.path.isfile(self.ca_bundle):
            raise ValueError(f"ClientSettings(ca_bundle=...) must be a PEM file of CAs, {self.ca_bundle!r} is not a "
                             f"file (None: the system's CAs)")

    def api_key(self) -> str | None:
        """The API key from `api_key_env`, or None where it is unset or empty; a key that cannot be
        sent as written (white space at either end, a character outside printable ASCII) refused
        naming the variable and what is wrong, never echoing the key nor stripping it silently."""
        key = os.environ.get(self.api_key_env) or None
        if key is not None:
            check_api_key(self.api_key_env, key)
        return key

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def check_api_key(variable: str, key: str) -> None:
    """ValueError naming `variable` (never showing `key`) where the key cannot be a bearer token as
    written: white space at either end (a newline pasted with it), or a character that is no
    printable ASCII (named by its position)."""
    wrong = None
    if key != key.strip():
        end = "ends" if key[-1:].isspace() else "starts"
        wrong = f"{end} with white space ({'a newline' if chr(10) in key or chr(13) in key else 'a space or tab'})"
    else:
        for position, char in enumerate(key):
            if not " " < char < "\x7f":
                what = "a non-ASCII character" if ord(char) > 127 else "a control character or space"
                wrong = f"holds {what} at position {position}"
                break
    if wrong is not None:
        raise ValueError(f"${variable}, the served teacher's API key, {wrong}: an HTTP header cannot carry it as "
                         f"written; set it to the key exactly as the server expects (nothing is stripped here)")


def seconds(name: str, value: object, allow_zero: bool) -> float:
    """`value` as a finite number of seconds (> 0, or >= 0 with `allow_zero`) a wait can take;
    ValueError naming `name` otherwise (`finite.wait_seconds`)."""
    return wait_seconds(name, value, allow_zero)
