"""How a served teacher behaves: its HTTP client (`ClientSettings`: timeouts, the step's deadline,
retries, what is in flight at once, the API key's variable and the CAs TLS is verified against)
and its replicas (`ReplicaSettings`: how they share a step). Standard library only."""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field, fields

from megatron_rl_patches.ops.scoring_plan import positive_int
from megatron_rl_patches.settings import TEACHER_API_KEY, api_key
from megatron_rl_patches.teachers.finite import finite, shown, utf8_text, wait_seconds
from megatron_rl_patches.teachers.served.spreading import FewestInFlight, PromptAffinity

API_KEY_ENV = TEACHER_API_KEY
MAX_REPLICAS = 1024  # a bound on the replicas a setting may name (no teacher has more URLs)


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
        key = api_key(self.api_key_env)
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

@dataclass(frozen=True)
class ReplicaSettings:
    """How a teacher's replicas share a step (ignored with one URL).

    `hedge_after`: a sample whose request has waited this multiple of the replicas' median request
    time (their latest answers, across steps; never less than `hedge_floor_s`, always within the
    step's deadline) is sent again to another healthy replica; the first answer wins and the other
    is cancelled (its reply dropped, no retry). Before any answer, a request past `hedge_floor_s`
    is sent again only to a replica with nothing in flight. None: no hedging.

    `spread`: how a sample picks its replica (`spreading`): `FewestInFlight()` (the default) or
    `PromptAffinity()`, the samples of one prompt (the same ids before their response start) on
    the replica the first of them went to while it is healthy. `keep_prompt_groups=True` is the
    same as `spread=PromptAffinity()`. Prompt affinity loads the replicas unevenly (a group of long
    samples on one replica while another idles). Neither given, replicas that are all
    `megatron-rl-patches serve-teacher` servers (their cards say so) are spread by prompt affinity,
    each computing a group's shared prompt once; any other servers by `FewestInFlight()`.

    `min_replicas`: the replicas that must answer (and agree) when the teacher connects; the others
    are named in one warning, left out, and asked again between steps (re-probed before use).

    `recheck_s`: every replica in use is probed again (its card and the probe, compared with the
    teacher's) at the start of the first step this many seconds after its last check, before that
    step sends it a sample: a server restarted behind the same URL with other weights is taken
    out, named in a warning, and the step is scored by the others. A replica is checked while the
    step's samples go to the rest (or wait for the first one back: one probe's time); None or 0:
    only a replica taken out is checked again. A change is found at the first step `recheck_s`
    after it, not sooner (a probe each step would cost each step a round trip to every replica).
    Ignored with one URL (nothing to compare with but itself)."""

    hedge_after: float | None = 3.0
    hedge_floor_s: float = 1.0
    keep_prompt_groups: bool = False
    spread: FewestInFlight | None = None
    min_replicas: int = 1
    recheck_s: float | None = 60.0
    spread_given: bool = field(default=False, init=False, repr=False, compare=False)  # spread or keep_prompt_groups

    def __post_init__(self) -> None:
        if self.hedge_after is not None and (not finite(self.hedge_after) or self.hedge_after < 1):
            raise ValueError(f"ReplicaSettings(hedge_after={shown(self.hedge_after)}) must be a finite multiple >= 1 "
                             f"of the replicas' median request time, or None (no hedging)")
        wait_seconds(f"ReplicaSettings(hedge_floor_s={shown(self.hedge_floor_s)})", self.hedge_floor_s, allow_zero=True)
        if not isinstance(self.keep_prompt_groups, bool):
            raise TypeError(f"ReplicaSettings(keep_prompt_groups=...) must be a bool, got "
                            f"{type(self.keep_prompt_groups).__name__}")
        if self.spread is not None and not isinstance(self.spread, FewestInFlight):
            raise TypeError(f"ReplicaSettings(spread=...) must be a spreading policy (FewestInFlight() or "
                            f"PromptAffinity()), got {type(self.spread).__name__}")
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, numbers.Integral) or \
                not 1 <= self.min_replicas <= MAX_REPLICAS:
            raise ValueError(f"ReplicaSettings(min_replicas={shown(self.min_replicas)}) must be an int from 1 to "
                             f"{MAX_REPLICAS} (the replicas that must answer at connect)")
        if self.recheck_s is not None:
            if isinstance(self.recheck_s, bool) or not isinstance(self.recheck_s, numbers.Real):
                raise TypeError(f"ReplicaSettings(recheck_s=...) must be a number of seconds or None (no re-check of "
                                f"the replicas in use), got {type(self.recheck_s).__name__}")
            wait_seconds(f"ReplicaSettings(recheck_s={shown(self.recheck_s)})", self.recheck_s, allow_zero=True)
            object.__setattr__(self, "recheck_s", float(self.recheck_s) or None)  # 0: off, as None
        spread = self.spread or (PromptAffinity() if self.keep_prompt_groups else FewestInFlight())
        if self.keep_prompt_groups and not isinstance(spread, PromptAffinity):
            raise ValueError(f"ReplicaSettings(keep_prompt_groups=True, spread={spread!r}): keep_prompt_groups=True "
                             f"is spread=PromptAffinity(); give one of the two")
        object.__setattr__(self, "spread_given", self.spread is not None or self.keep_prompt_groups)
        object.__setattr__(self, "spread", spread)
        object.__setattr__(self, "keep_prompt_groups", isinstance(spread, PromptAffinity))
