"""The HTTP client of a served teacher (`TeacherClient`): one connection pool per teacher
(keep-alive), JSON requests with timeouts, retries with backoff on connection errors and 5xx
only, a deadline per step, an API key from the environment, TLS verified against the system's CAs
(or a bundle), the standard proxy variables honoured. httpx is the optional extra `served`.

The deadline is a wall-clock bound on the whole request: httpx's timeouts bound each read, so a
server that trickles its reply (a byte a second) would outlive any of them. Each attempt therefore
runs in a thread of its own that the caller waits for until the deadline only; past it the
connection pool is closed (the abandoned attempt fails at its next byte) and the caller raises."""
from __future__ import annotations

import functools
import os
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.inference.loading.hf.extras import install_hint
from megatron_rl_patches.inference.loading.json_read import parsed_json
from megatron_rl_patches.settings import api_key, ca_variables
from megatron_rl_patches.teachers.errors import ServedTeacherError, ServedTeacherRefusal
from megatron_rl_patches.teachers.finite import utf8_text
from megatron_rl_patches.teachers.redaction import has_userinfo, key_variable, redacted, without_key
from megatron_rl_patches.teachers.served.metrics import Recorder
from megatron_rl_patches.teachers.served.settings import ClientSettings

BACKOFF_CAP_S = 8.0
QUOTED = 500  # characters of a server's error text quoted


def check_url(url: object) -> str:
    """The teacher's base URL without its trailing '/': http(s)://host[:port][/path], no user or
    password (the key comes from the environment; refused on the raw text, never echoed), no
    query. Every message shows the URL `redacted`."""
    if not isinstance(url, str):
        raise TypeError(f"the teacher's url must be a str like 'http://host:port', got {type(url).__name__}")
    if has_userinfo(url):
        raise ValueError(f"the teacher's url {redacted(url)!r} carries a user or password: put the API key in an "
                         f"environment variable (ClientSettings.api_key_env), never in the url")
    return url_form(url)


def url_form(url: str) -> str:
    """`check_url` less the user-or-password scan, for a URL whose text was refused one where it
    came in (an entry: `teachers.kinds`): http or https, a host, no query, a port that is a number,
    UTF-8 text; its trailing '/' dropped."""
    utf8_text(url, "the teacher's url")  # httpx's bare InvalidURL at the first request otherwise
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"the teacher's url must be http://host:port or https://host:port, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"the teacher's url must be a base address without '?' or '#', got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a port that is no number
    except ValueError as error:
        raise ValueError(f"the teacher's url {url!r} has a bad port: {error}") from None
    return url.rstrip("/")


@dataclass
class Deadline:
    """A step's deadline: `seconds` from `start` (monotonic)."""

    seconds: float
    start: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(seconds, time.monotonic())

    @property
    def at(self) -> float:
        return self.start + self.seconds

    def remaining(self) -> float:
        return self.at - time.monotonic()


def server_words(response: Any, key: str | None) -> str:
    """What a server said in an error reply: its JSON `message` / `error.message` / `detail`, else
    the start of its text; the API key `key` (and any bearer token) taken out before it is cut."""
    try:
        body = response.json()
    except ValueError:
        return without_key(response.text[:QUOTED + len(key or "")], key)[:QUOTED]
    if isinstance(body, dict):
        error = body.get("error")
        for said in (body.get("message"), error.get("message") if isinstance(error, dict) else error,
                     body.get("detail")):
            if said:
                return without_key(str(said), key)
    return without_key(response.text[:QUOTED + len(key or "")], key)[:QUOTED]


CA_FILE, CA_DIR = "SSL_CERT_FILE", "SSL_CERT_DIR"  # OpenSSL's variables for the system's CAs
CA_FIX = ("point it at a PEM file of CAs (SSL_CERT_DIR: a folder of them), unset it, or give "
          "ClientSettings(ca_bundle=PEM)")
CA_WHERE = "where OpenSSL finds the system's CAs a served teacher's TLS is verified against"


def tls_context(ca_bundle: str | None) -> ssl.SSLContext:
    """The verifying TLS context of every client given `ca_bundle` (None: the system's CAs, from
    OpenSSL's default paths or SSL_CERT_FILE / SSL_CERT_DIR), loaded once per process: loading the
    system's CAs costs ~30 ms, and a step opens a client per teacher and replica. A bundle file or a
    CA variable changed, or a file it names rewritten or replaced (even with its old mtime set back),
    is loaded again. A ValueError naming the bundle or the variable where it gives no CA (OpenSSL
    skips a missing, unreadable or malformed default path without a word)."""
    key = (stamp(ca_bundle),) if ca_bundle is not None else \
        tuple((value, stamp(value)) for value in ca_variables())
    return loaded_context(ca_bundle, *key)


def stamp(path: str | None) -> tuple[int, ...] | None:
    """What changes when the file at `path` is rewritten or replaced: its device, inode, size, and
    modification and change times (the change time cannot be set back); None where it is none."""
    try:
        held = os.stat(path) if path else None
    except (OSError, ValueError):
        return None
    return None if held is None else (held.st_dev, held.st_ino, held.st_size, held.st_mtime_ns, held.st_ctime_ns)


@functools.lru_cache(maxsize=8)
def loaded_context(ca_bundle: str | None, *key: Any) -> ssl.SSLContext:
    """`tls_context`'s load, cached per process (`key`: what the bundle's or the variables' files are
    now, the cache key only; `loaded_context.cache_clear()` forgets every context). A refusal is
    not cached: the next client is told again."""
    variables = dict(zip((CA_FILE, CA_DIR), ca_variables()))
    if ca_bundle is None:
        for name, wanted, kind in ((CA_FILE, os.path.isfile, "file"), (CA_DIR, os.path.isdir, "folder")):
            value = variables[name]
            if value and not wanted(value):
                what = "a folder" if os.path.isdir(value) else "a file" if os.path.exists(value) else "not there"
                raise ValueError(f"{name}={value!r} ({CA_WHERE}) is no {kind}, it is {what}: {CA_FIX}")
    try:
        context = ssl.create_default_context(cafile=ca_bundle)
    except (ssl.SSLError, OSError) as error:
        raise ValueError(f"ClientSettings(ca_bundle={ca_bundle!r}) holds no CA OpenSSL reads ({error}): give a PEM "
                         f"file of CAs") from None
    value = variables[CA_FILE]
    if ca_bundle is None and value and not context.cert_store_stats()["x509"]:
        raise ValueError(f"{CA_FILE}={value!r} ({CA_WHERE}) holds no certificate OpenSSL reads (PEM): {CA_FIX}")
    return context


class TeacherClient:
    """One teacher's connection pool (created on first use, thread-safe: a step's requests run
    from several threads at once)."""

    def __init__(self, url: str, settings: ClientSettings, recorder: Recorder | None = None) -> None:
        self.url = check_url(url)
        self.settings = settings
        self.recorder = recorder or Recorder()  # the bytes received and the retries, for the teacher's metrics
        key_variable(settings.api_key_env)  # its key, whatever a server quotes of it, hidden in every message
        tls_context(settings.ca_bundle)  # a bundle or CA variable that gives no CA refused here, not at a request
        self._http: Any = None
        self._lock = threading.Lock()
        self._closed = False  # close(): no attempt starts, and every wait for one ends at once
        self._changed = threading.Condition(self._lock)  # an attempt ended, or the client closed

    def http(self) -> Any:
        with self._lock:
            if self._closed:
                raise ServedTeacherError(f"{self.url}: the teacher was closed", self.url)
            if self._http is None:
                self._http = self._open()
            return self._http

    def _open(self) -> Any:
        try:
            import httpx  # lazy: optional dependency httpx (the extra `served`)
        except ImportError:
            raise ImportError(f"a served teacher needs httpx: {install_hint('served', 'httpx')}") from None
        s = self.settings
        headers = {"Authorization": f"Bearer {s.api_key()}"} if s.api_key() else {}
        verify = tls_context(s.ca_bundle)
        limits = httpx.Limits(max_connections=s.max_in_flight, max_keepalive_connections=s.max_in_flight)
        return httpx.Client(headers=headers, verify=verify, limits=limits, trust_env=True,
                            timeout=httpx.Timeout(s.timeout_s, connect=s.connect_timeout_s))

    def key(self) -> str | None:
        """The API key as the environment holds it (what a server could quote back), or None."""
        return api_key(self.settings.api_key_env)

    def quoted(self, text: str) -> str:
        """`text` (a server's words, an exception's) as a message may quote it: without the API key."""
        return without_key(text, self.key())

    def close(self) -> None:
        """Close the pool and end every wait for a reply now: the threads that wait (a step's,
        the replicas' probes) fail at once instead of holding the interpreter's exit until a
        silent server's timeout."""
        with self._lock:
            self._closed = True
            http, self._http = self._http, None
            self._changed.notify_all()
        if http is not None:
            http.close()

    def abandon(self, http: Any) -> None:
        """Close the pool `http` (its connections cut, their requests failing at their next read)
        and start a new one on next use: an attempt past the deadline is not waited for."""
        with self._lock:
            if self._http is http:
                self._http = None
        http.close()

    def within(self, deadline: Deadline, call: Callable[[], Any], http: Any) -> tuple[bool, Any]:
        """`call()` (one HTTP attempt on the pool `http`) run in a thread of its own and waited
        for until `deadline`: (True, its result), its exception raised here, or (False, None) when
        the deadline passed first or the client was closed, the pool then abandoned (the attempt's
        own thread is a daemon: left blocked in a read, it holds no exit)."""
        outcome: list[Any] = []

        def attempt() -> None:
            try:
                result = (True, call())
            except BaseException as error:  # noqa: BLE001 - handed to the waiting caller
                result = (False, error)
            with self._changed:
                outcome.append(result)
                self._changed.notify_all()

        worker = threading.Thread(target=attempt, name="served-teacher-request", daemon=True)
        with self._changed:
            if not self._closed:
                worker.start()
                self._changed.wait_for(lambda: outcome or self._closed, max(deadline.remaining(), 0.0))
        # closed meanwhile: what the attempt raised on the closed pool (httpx's RuntimeError "the client has
        # been closed", a read cut short) is the close, not the server's answer
        if not outcome or (self._closed and not outcome[0][0]):
            self.abandon(http)
            return False, None
        ok, value = outcome[0]
        if not ok:
            raise value
        return True, value

    def request(self, method: str, path: str, body: Any, deadline: Deadline, cancel: threading.Event,
                sample: int | None = None, raw: bool = False) -> Any:
        """The JSON reply to `method path` (`body` as JSON), retried on connection errors and 5xx
        until `retries` or the deadline; a 4xx is a `ServedTeacherRefusal` with the server's words.
        `raw`: the reply itself (httpx's Response: a binary body and its headers), undecoded."""
        import httpx  # lazy: optional dependency httpx (the extra `served`)

        s = self.settings
        who = f"{self.url}{path}" + ("" if sample is None else f" (sample {sample})")
        attempt, last = 0, ""
        while True:
            if attempt and cancel.is_set():  # stopped: its sample answered elsewhere, or the step failed
                tries = f"{attempt} tr{'y' if attempt == 1 else 'ies'}"
                raise ServedTeacherError(f"{who}: no answer after {tries} ({last}), then stopped (its sample answered "
                                         f"elsewhere, or the step failed)", self.url, sample)
            left = deadline.remaining()
            if left <= 0:
                raise ServedTeacherError(f"{who}: no answer within the step's deadline of {deadline.seconds:g} s"
                                         + (f" (last: {last})" if last else ""), self.url, sample)
            timeout = httpx.Timeout(min(s.timeout_s, left), connect=min(s.connect_timeout_s, left))
            http = self.http()  # a new pool after one abandoned at a deadline
            try:
                attempt_once = functools.partial(http.request, method, self.url + path, json=body, timeout=timeout)
                answered, response = self.within(deadline, attempt_once, http)
                if not answered and self._closed:
                    raise ServedTeacherError(f"{who}: the teacher was closed while it waited for the reply",
                                             self.url, sample)
                if not answered:
                    raise ServedTeacherError(f"{who}: no reply within the step's deadline of "
                                             f"{deadline.seconds:g} s (the server silent or still sending: "
                                             f"connection closed)" + (f"; earlier: {last}" if last else ""),
                                             self.url, sample)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError,
                    httpx.RemoteProtocolError, httpx.CloseError) as error:
                last = f"{type(error).__name__}: {self.quoted(str(error))}"
                if isinstance(error, httpx.ConnectError) and "CERTIFICATE_VERIFY_FAILED" in str(error):
                    raise ServedTeacherError(f"{who}: TLS verification failed ({self.quoted(str(error))}); give "
                                             f"the server's CA as ClientSettings(ca_bundle=PEM)", self.url,
                                             sample) from None
            except httpx.TimeoutException as error:
                bound = (f"the step's deadline of {deadline.seconds:g} s" if left < s.timeout_s
                         else f"ClientSettings(timeout_s={s.timeout_s:g})")
                raise ServedTeacherError(f"{who}: no reply within {bound} ({type(error).__name__})",
                                         self.url, sample) from None
            except httpx.HTTPError as error:
                raise ServedTeacherError(f"{who}: {type(error).__name__}: {self.quoted(str(error))}", self.url,
                                         sample) from None
            else:
                if 300 <= response.status_code < 400:  # httpx follows no redirect: refuse it by name
                    where = self.quoted(redacted(response.headers.get("location", "nowhere named")))
                    raise ServedTeacherRefusal(f"{who}: the server redirects (HTTP {response.status_code} to "
                                               f"{where!r}), and a served teacher follows no redirect: give the "
                                               f"URL the server answers at", self.url, sample)
                if response.status_code < 400:
                    self.recorder.add("bytes", len(response.content))
                    return response if raw else decode(response.content, who, self.url, sample)
                last = f"HTTP {response.status_code}: {server_words(response, self.key())}"
                if response.status_code < 500:
                    raise refusal(response.status_code, last, who, self.url, sample, s)
            if attempt >= s.retries or cancel.is_set():
                tries = f"{attempt + 1} tr{'y' if attempt == 0 else 'ies'}"
                raise ServedTeacherError(f"{who}: no answer after {tries} ({last})", self.url, sample)
            cancel.wait(min(s.backoff_s * 2 ** attempt, BACKOFF_CAP_S, max(deadline.remaining(), 0.0)))
            attempt += 1
            self.recorder.add("retries")


def decode(content: bytes, who: str, url: str, sample: int | None) -> Any:
    """The reply's JSON: orjson where installed (the extra `served`; twice json's speed on the
    megabytes of a long sample's log-probs), json otherwise and for what orjson refuses (NaN)."""
    return parsed_json(content, lambda problem: ServedTeacherError(f"{who}: the reply {problem}", url, sample),
                       fast_loads())


@functools.cache
def fast_loads() -> Callable[[bytes], Any] | None:
    """orjson's reader where installed (None: json's alone)."""
    try:
        import orjson  # lazy: optional dependency orjson (the extra `served`)
    except ImportError:
        return None
    return orjson.loads


def refusal(status: int, words: str, who: str, url: str, sample: int | None,
            settings: ClientSettings) -> ServedTeacherRefusal:
    if status in (401, 403):
        return ServedTeacherRefusal(f"{who}: {words}: set ${settings.api_key_env} to the server's API key", url, sample)
    return ServedTeacherRefusal(f"{who} refused the request: {words}", url, sample)
