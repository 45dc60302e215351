"""The served lane's forwarder (tests/teachers/lane/forwarder.py) plays a server that dies: `close`
must reset a connection whose request is in flight at once, as a dead server's kernel does. A
pump blocked in `recv` kept the socket open past `close` (Linux frees it when that call returns):
the client waited for its deadline instead, and the lane's every-replica-killed test read "no
reply within the step's deadline" for "every replica failed" (CI, 1 run in several)."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.teachers.lane.forwarder import Forwarder


@pytest.fixture
def slow_upstream():
    """A server that reads a request and answers it after 5 s (a teacher mid-forward)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        conn.recv(64)
        stop.wait(5)
        try:
            conn.sendall(b"late")
        except OSError:
            pass
        conn.close()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    stop.set()
    server.close()


def test_close_resets_a_connection_whose_request_is_in_flight(slow_upstream):
    link = Forwarder(slow_upstream)
    client = socket.create_connection(("127.0.0.1", link.port), timeout=3)
    client.sendall(b"request")
    assert link.accepted.acquire(timeout=3)
    time.sleep(0.2)  # both pumps blocked in recv: the request forwarded, its answer not back
    start = time.monotonic()
    link.close()
    with pytest.raises(ConnectionResetError):
        client.recv(64)
    assert time.monotonic() - start < 1.0
    with pytest.raises(ConnectionRefusedError):  # then refused, as a dead server's port
        socket.create_connection(("127.0.0.1", link.port), timeout=3)
    client.close()
