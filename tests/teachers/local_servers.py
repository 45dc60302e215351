"""Small HTTP servers on 127.0.0.1 for the served teacher's tests (beside the served lane's real
vLLM server): one that answers as vLLM does, with replies a test may replace route by route (a
slow route: `held`; a server that dies mid-step: `dies_after`), and one that trickles its reply a
byte at a time (a stalled proxy, an overloaded engine)."""
from __future__ import annotations

import contextlib
import http.server
import json
import math
import socketserver
import threading
from collections.abc import Callable, Iterator
from typing import Any

MODEL, MAX_MODEL_LEN = "m", 64
# route -> (status, JSON-able body or raw bytes or TRICKLE), given the request's JSON body (None for a GET)
Route = Callable[[Any], tuple[int, Any]]
TRICKLE = object()  # a reply of a promised long body sent a byte a second
DIE = object()  # the server dies here: this request and every later one cut without a reply


def trickle(_: Any) -> tuple[int, Any]:
    return 200, TRICKLE


def models(_: Any) -> tuple[int, Any]:
    return 200, {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": MAX_MODEL_LEN}]}


def prompt_logprobs(ids: list[int], k: int) -> list[Any]:
    """vLLM's `prompt_logprobs` for `ids`: at every position p >= 1 the ids 0..k-1 at
    probabilities 1/2, 1/4, ... (ranks 1..k) and the actual id beside them when outside."""
    positions: list[Any] = [None]
    for actual in ids[1:]:
        entry = {str(i): {"logprob": -(i + 1) * math.log(2.0), "rank": i + 1, "decoded_token": None} for i in range(k)}
        if actual >= k:
            entry[str(actual)] = {"logprob": -30.0, "rank": actual + 1, "decoded_token": None}
        positions.append(entry)
    return positions


def completions(body: Any) -> tuple[int, Any]:
    return 200, {"choices": [{"index": 0, "text": "", "prompt_logprobs": prompt_logprobs(body["prompt"],
                                                                                           body["prompt_logprobs"])}]}


def tokenize(body: Any) -> tuple[int, Any]:
    """The prompt's words as ids (a word `t7` is id 7), as a word-level tokenizer spells them."""
    return 200, {"tokens": [int(word[1:]) for word in body["prompt"].split()], "count": 0, "max_model_len": 64}


def held(release: threading.Event, route: Route = completions, seconds: float = 60.0) -> Route:
    """`route`, answered once `release` is set (or after `seconds`): a slow or paused replica."""
    def answer(body: Any) -> tuple[int, Any]:
        release.wait(seconds)
        return route(body)
    return answer


def dies_after(answers: int, route: Route = completions) -> Route:
    """`route` for its first `answers` requests; then the server dies (`DIE`): a replica killed
    mid-step (connections cut without a reply, as a reset)."""
    count = [0]
    lock = threading.Lock()

    def answer(body: Any) -> tuple[int, Any]:
        with lock:
            count[0] += 1
            if count[0] > answers:
                return 0, DIE
        return route(body)
    return answer


VLLM_ROUTES: dict[str, Route] = {"/v1/models": models, "/v1/completions": completions, "/tokenize": tokenize}


class VllmLike(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, routes: dict[str, Route]) -> None:
        super().__init__(("127.0.0.1", 0), Answer)
        self.routes = routes
        self.stop = threading.Event()
        self.dead = False
        self.seen: list[tuple[str, dict[str, str]]] = []  # (path, headers) of every request
        self.bodies: list[tuple[str, Any]] = []  # (path, JSON body or None) of every request

    def answered(self, path: str) -> int:
        """How many requests to `path` reached this server."""
        return sum(1 for seen, _ in self.seen if seen == path)


class Answer(http.server.BaseHTTPRequestHandler):
    server: VllmLike

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        self.answer(None)

    def do_POST(self) -> None:  # noqa: N802 - the standard library's name
        self.answer(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))))

    def answer(self, body: Any) -> None:
        self.server.seen.append((self.path, dict(self.headers)))
        self.server.bodies.append((self.path, body))
        route = self.server.routes.get(self.path)
        status, reply = (0, DIE) if self.server.dead else (404, {"detail": "Not Found"}) if route is None \
            else route(body)
        if reply is DIE:
            self.server.dead = True
            self.close_connection = True
            return
        if reply is TRICKLE:
            with contextlib.suppress(OSError):
                self.wfile.write(BODY)
                self.wfile.flush()
                while not self.server.stop.wait(1.0):
                    self.wfile.write(b" ")
                    self.wfile.flush()
            return
        extra: dict[str, str] = {}
        if isinstance(reply, tuple):  # (raw body, headers): a binary reply with its metadata header
            reply, extra = reply
        data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
        self.send_response(status)
        for name, value in extra.items():
            self.send_header(name, value)
        if isinstance(reply, dict) and "location" in reply:
            self.send_header("Location", reply["location"])
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def vllm_like(**routes: Route) -> Iterator[VllmLike]:
    """A server answering as vLLM does (`VLLM_ROUTES`), with `routes` replaced (a keyword is the
    route without its first '/' and with '_' for '/': v1_completions, tokenize, v1_models)."""
    table = dict(VLLM_ROUTES)
    table.update({"/" + name.replace("_", "/"): route for name, route in routes.items()})
    with serving(VllmLike(table)) as server:
        yield server


@contextlib.contextmanager
def serving(server: Any) -> Iterator[Any]:
    """`server` (with a `stop` event) serving from a thread until the block ends."""
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield server
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()


def url_of(server: socketserver.TCPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


class Trickler(socketserver.ThreadingTCPServer):
    """Reads a request's first bytes, then sends `head` at once and a byte every `every` seconds
    after it (`HEADERS`: inside the status line's headers; `BODY`: inside a promised long body),
    until the client goes or the server stops."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, head: bytes, every: float = 1.0) -> None:
        super().__init__(("127.0.0.1", 0), Trickle)
        self.head, self.every = head, every
        self.stop = threading.Event()


HEADERS = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Trickle: "
BODY = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"data\": ["


class Trickle(socketserver.BaseRequestHandler):
    server: Trickler

    def handle(self) -> None:
        self.request.settimeout(5)
        with contextlib.suppress(OSError):
            self.request.recv(65536)
            self.request.sendall(self.server.head)
            while not self.server.stop.wait(self.server.every):
                self.request.sendall(b" ")


@contextlib.contextmanager
def trickling(head: bytes = BODY, every: float = 1.0) -> Iterator[Trickler]:
    with serving(Trickler(head, every)) as server:
        yield server

