"""Progress lines of a benchmark on stderr, so a long one is never silent: a line as each case ends
(`CaseLines`) and, while a benchmark runs, a line at least every 30 s (`ticking`): a full-size case
can take minutes."""
from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

HEARTBEAT_S = 30.0


class CaseLines:
    """`  case 3/12 done (4.1 s): LABEL` as each of `total` cases ends (the seconds since the last)."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total, self.done, self.since, self.stream = total, 0, time.perf_counter(), stream

    def ended(self, label: str, failed: bool = False) -> None:
        self.done += 1
        now = time.perf_counter()
        print(f"  case {self.done}/{self.total} {'failed' if failed else 'done'} ({now - self.since:.1f} s): "
              f"{label}".rstrip(), file=self.stream or sys.stderr, flush=True)
        self.since = now


class ticking:
    """`with ticking("bench fused"):` prints `  bench fused: still running (30 s)` every `every`
    seconds until the block ends (a daemon thread; nothing after the block)."""

    def __init__(self, what: str, every: float = HEARTBEAT_S, stream: TextIO | None = None) -> None:
        if not every > 0:
            raise ValueError(f"every={every!r}: the seconds between progress lines must be > 0")
        self.what, self.every, self.stream = what, every, stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name=f"progress: {what}", daemon=True)

    def _tick(self) -> None:
        started = time.perf_counter()
        while not self._stop.wait(self.every):
            print(f"  {self.what}: still running ({time.perf_counter() - started:.0f} s)",
                  file=self.stream or sys.stderr, flush=True)

    def __enter__(self) -> ticking:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
