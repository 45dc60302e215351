"""A loopback TCP forwarder in front of a real server, for the failure tests: after `hold_all` it
takes connections and answers nothing (a server hung mid-step); `close` resets every connection and
stops listening (a server that died: connections reset, then refused); `retarget` puts another server
behind the same URL (the open connections reset), `restart` too (closed as a stopped server's are)."""
from __future__ import annotations

import contextlib
import socket
import struct
import threading


class Forwarder:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port, self.hold = upstream_port, False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()  # the open sockets, against a reset from another thread
        self.accepted = threading.Semaphore(0)
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                if self.closed:  # accepted as it closed: reset, as a dead server's
                    reset(client)
                    return
                self.sockets.append(client)
            self.accepted.release()
            if not self.hold:
                try:
                    upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
                except OSError:  # nothing behind it now: the connection reset, as a dead server's
                    reset(client)
                    continue
                with self.lock:
                    if not any(sock is client for sock in self.sockets):  # reset meanwhile: the pair goes with it
                        reset(upstream)
                        continue
                    self.sockets.append(upstream)
                threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
                threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, target: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                target.sendall(data)

    def retarget(self, upstream_port: int) -> None:
        """Forward to another server from now on (a server restarted behind the same URL): the open
        connections reset."""
        self.upstream_port = upstream_port
        self._reset()

    def restart(self, upstream_port: int) -> None:
        """Forward to another server from now on, the open connections closed as a stopped server's
        are (FIN, not a reset): a server restarted behind the same URL between steps, which a
        client's next request does not notice (it opens a new connection)."""
        self.upstream_port = upstream_port
        with self.lock:
            sockets, self.sockets = self.sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def hold_all(self) -> None:
        """From now on answer nothing: the open connections reset, new ones held."""
        self.hold = True
        self._reset()

    def close(self) -> None:
        """Reset every connection and stop listening."""
        with self.lock:
            self.closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        with contextlib.suppress(OSError):
            self.listener.close()
        self._reset()

    def _reset(self) -> None:
        with self.lock:
            sockets, self.sockets = self.sockets, []
        for sock in sockets:
            reset(sock)


def reset(sock: socket.socket) -> None:
    """`sock` closed with a reset (RST). A pump blocked in `recv` on it holds the socket open past
    `close` (Linux frees it when that call returns; a client mid-request then waits for its deadline
    instead of seeing the server die): shutting its reading side first wakes that call."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()
