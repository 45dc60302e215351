"""Work a served-lane module does on its own — servers of its own, the example run as pasted — begun
in the background while the lane's other tests run (`EarlyWork`), so its loading fills the cores
those tests leave idle.

A vLLM server loads on one core (16 s of one core, alone or beside another), and the lane's tests
against its shared servers mostly wait on them; begun only when its module's first test asks (as
before), each module's own servers loaded one module after another with a core idle. A module offers
its work (`offer`, at import: a `Job`); once the lane's shared servers are ready, the jobs are
begun one at a time in the order the modules run, each when the machine's available memory takes
its peak with room to spare, the next once its peak is behind it (its servers ready). A module's
fixture takes its job's handle (`EarlyWork.take`): begun early, or begun then (never twice). What
no test took is ended with the session (`server_job`: a job of servers only)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.testing.vllm_server import SERVER_PEAK_BYTES, VllmServer, available_bytes, stop, wait_ready

# memory kept free beside a job's peak: the tests' own process and the ranks they spawn
RESERVE_BYTES = 4 << 30


@dataclass(frozen=True)
class Job:
    """`units`: the job's memory at its peak, in lane servers' peaks; `begin(root, directory)` (the
    lane's folder and checkpoint) starts it without waiting and gives its handle; `settle(handle)`
    returns once its memory peak is behind it; `end(handle)` stops a handle no test took."""

    module: str
    units: int
    begin: Callable[[Any, Any], Any]
    settle: Callable[[Any], None]
    end: Callable[[Any], None]


def server_job(module: str, units: int, begin: Callable[[Any, Any], Any],
               servers: Callable[[Any], Iterable[VllmServer]]) -> Job:
    """A job of `units` vLLM servers (`servers(handle)`): settled once each is ready, ended by
    stopping each."""
    def settle(handle: Any) -> None:
        for server in servers(handle):
            wait_ready(server, 600.0)

    def end(handle: Any) -> None:
        for server in servers(handle):
            stop(server.process)

    return Job(module, units, begin, settle, end)


JOBS: dict[str, Job] = {}


def offer(name: str, job: Job) -> None:
    """`job` offered to the lane under `name` (a module does this at import)."""
    JOBS[name] = job


def fits(units: int) -> bool:
    """Whether `units` server peaks fit the available memory beside the reserve (never where it cannot be read)."""
    available = available_bytes()
    return available is not None and available >= units * SERVER_PEAK_BYTES + RESERVE_BYTES


class EarlyWork:
    """The jobs `names` (in the order their modules run) begun one at a time in a thread once
    `lane_ready()` returns: the first waiting one that `fits`, the next once it has settled. (Two
    at once measured slower: the lane's tests, ranks and servers then oversubscribe the cores.)"""

    def __init__(self, names: Sequence[str], root: Any, directory: Any, lane_ready: Callable[[], None],
                 poll_s: float = 1.0) -> None:
        self.names, self.root, self.directory, self.poll_s = list(names), root, directory, poll_s
        self.lock = threading.Lock()
        self.begun: dict[str, Any] = {}
        self.failed: dict[str, BaseException] = {}
        self.taken: set[str] = set()
        self.closing = threading.Event()
        self.clock = time.monotonic()
        self.said: list[str] = []  # when each job was begun and settled: root/early-work.log
        self.thread = threading.Thread(target=self.run, args=(lane_ready,), name="served lane: early work",
                                       daemon=True)
        self.thread.start()

    def run(self, lane_ready: Callable[[], None]) -> None:
        try:
            lane_ready()
        except Exception:  # noqa: BLE001 - the lane's own fixtures report a server that never got ready
            return
        while not self.closing.is_set():
            with self.lock:
                waiting = [name for name in self.names if name not in self.begun and name not in self.failed]
                if not waiting or self.closing.is_set():
                    return
                chosen = next((name for name in waiting if fits(JOBS[name].units)), None)
                if chosen is not None:
                    self.note(f"begun early: {chosen}")
                    try:
                        self.begun[chosen] = JOBS[chosen].begin(self.root, self.directory)
                    except Exception as error:  # noqa: BLE001 - handed to the test that takes it
                        self.failed[chosen] = error
                        continue
            if chosen is None:
                self.closing.wait(self.poll_s)
                continue
            try:
                JOBS[chosen].settle(self.begun[chosen])
                self.note(f"settled: {chosen}")
            except Exception as error:  # noqa: BLE001 - the taker waits for it again and reports it
                self.note(f"settling {chosen} failed: {error!r:.200}")

    def note(self, what: str) -> None:
        available = available_bytes()
        memory = "unknown" if available is None else f"{available / (1 << 30):.1f} GiB"
        self.said.append(f"{time.monotonic() - self.clock:7.1f} s  {what} (available memory {memory})")

    def take(self, name: str) -> Any:
        """`name`'s handle: the one begun early, or begun now."""
        with self.lock:
            self.taken.add(name)
            self.note(f"taken: {name}{'' if name in self.begun else ' (begun now)'}")
            if name in self.failed:
                raise self.failed.pop(name)
            if name not in self.begun:
                self.begun[name] = JOBS[name].begin(self.root, self.directory)
            return self.begun[name]

    def close(self) -> None:
        """No more jobs begun; those no test took ended (a job settling then fails at once: its processes are gone)."""
        with self.lock:
            self.closing.set()
            for name, handle in self.begun.items():
                if name not in self.taken:
                    JOBS[name].end(handle)
        self.thread.join(timeout=60)
        (self.root / "early-work.log").write_text("\n".join(self.said) + "\n")
