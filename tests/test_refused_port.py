"""The tests' dead server (`kit.ports.refused_port`) is free by construction: while it is held no
other socket can bind its port — a server's, which sets SO_REUSEADDR, included — and every
connect to it is refused (a port bound and released at once could be taken and answered:
CI's "Connection reset by peer" where `ConnectError` was expected)."""
from __future__ import annotations

import errno
import socket

import pytest
from kit.ports import refused_port


def test_a_held_port_cannot_be_taken_and_refuses_every_connect():
    with refused_port() as port:
        for reuse in (False, True):
            with socket.socket() as other:
                if reuse:  # as an HTTP server binds
                    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with pytest.raises(OSError) as taken:
                    other.bind(("127.0.0.1", port))
                assert taken.value.errno == errno.EADDRINUSE
        for _ in range(3):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
