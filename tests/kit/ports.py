"""A loopback port nothing listens on, free by construction (`refused_port`): the tests' dead
server. A port bound and released at once may be taken by another process before the test
connects (CI: a reset where `ConnectError` was expected); this one stays bound, never listening,
until the block ends, so every connect to it is refused and no other socket can bind it (the
socket sets no SO_REUSEADDR: Linux lets no second socket bind a port held so)."""
from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """The port, held (bound, not listening) while the block runs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]
