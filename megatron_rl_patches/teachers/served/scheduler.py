"""One step of a teacher's replicas (`StepReplicas.run`): each sample sent to the healthy replica
with the fewest requests in flight (or its prompt group's, `keep_prompt_groups`); a replica that
fails (refused, reset, 5xx after the client's retries, a read timeout) is taken out for the rest
of the step and the sample re-sent to another; a request past the hedging point (`hedge_after`
times the step's median request time, at least `hedge_floor_s`) is sent again to another
replica, the first answer winning and the other cancelled. The sample fails only when every
replica has failed (or the deadline passed); a 4xx refusal is the request's, raised as it is."""
from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from megatron_rl_patches.teachers.errors import ServedTeacherError, ServedTeacherRefusal
from megatron_rl_patches.teachers.redaction import redacted

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.teachers.served.http import Deadline
    from megatron_rl_patches.teachers.served.replica_settings import ReplicaSettings

T = TypeVar("T")
POLL_S = 0.05  # how often a waiting sample looks whether it is due a hedge


@dataclass
class Replica:
    """One server of a teacher: its URL, client and engine, and its requests in flight now."""

    url: str
    client: Any
    engine: Any
    in_flight: int = field(default=0, compare=False)


class AttemptCancel(threading.Event):
    """One request's cancel: set itself (the sample answered elsewhere), the step's, or its
    replica taken out (another request found it failed: no more retries there)."""

    def __init__(self, step: threading.Event, out: Callable[[], bool]) -> None:
        super().__init__()
        self.step, self.out = step, out

    def is_set(self) -> bool:
        return super().is_set() or self.step.is_set() or self.out()

    def wait(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = POLL_S if end is None else min(POLL_S, end - time.monotonic())
            if left <= 0:
                return False
            super().wait(left)
        return True


class StepReplicas:
    """A step's view of the replicas: which are taken out (with their errors), the answered
    requests' times, the prompt groups' replicas."""

    def __init__(self, replicas: list[Replica], settings: ReplicaSettings, url: str, lock: threading.Lock) -> None:
        self.replicas, self.settings, self.url, self.lock = replicas, settings, url, lock
        self.out: dict[int, BaseException] = {}
        self.times: list[float] = []
        self.homes: dict[Hashable, int] = {}
        self.turn = 0  # ties of requests in flight go round the replicas

    def run(self, call: Callable[[Any, threading.Event], T], sample: int, prompt: Hashable, deadline: Deadline,
            cancel: threading.Event) -> T:
        """`call(engine, cancel)` for `sample` (its prompt ids `prompt`) on the replicas, until one
        answers (see the module's words)."""
        answers: queue.Queue = queue.Queue()
        live: dict[int, tuple[AttemptCancel, float]] = {}  # replica -> (its cancel, when sent)
        while True:
            if cancel.is_set():
                self.drop(live)
                raise ServedTeacherError(f"{self.url}: sample {sample} not answered: the step failed before",
                                         self.url, sample)
            if not live and not self.send(call, sample, prompt, live, answers, cancel):
                raise self.all_failed(sample)
            left = deadline.remaining()
            if left <= 0:
                self.drop(live)
                asked = ", ".join(redacted(self.replicas[i].url) for i in live)
                raise ServedTeacherError(f"{self.url} (sample {sample}): no reply within the step's deadline of "
                                         f"{deadline.seconds:g} s (asked: {asked})", self.url, sample)
            try:
                index, ok, value, seconds = answers.get(timeout=min(POLL_S, left))
            except queue.Empty:
                if self.hedge_due(live):
                    self.send(call, sample, None, live, answers, cancel)
                continue
            live.pop(index, None)
            if ok:
                self.drop(live)
                with self.lock:
                    self.times.append(seconds)
                return value
            if isinstance(value, ServedTeacherRefusal) or not isinstance(value, ServedTeacherError):
                self.drop(live)
                raise value
            if not cancel.is_set():
                with self.lock:
                    self.out.setdefault(index, value)

    def send(self, call: Callable[[Any, threading.Event], Any], sample: int, prompt: Hashable | None,
             live: dict[int, tuple[AttemptCancel, float]], answers: queue.Queue, cancel: threading.Event) -> bool:
        """Send the sample to a healthy replica not asked for it now (False: there is none)."""
        index = self.choose(set(live), prompt)
        if index is None:
            return False
        replica, mine = self.replicas[index], AttemptCancel(cancel, lambda: index in self.out)
        live[index] = (mine, time.monotonic())

        def attempt() -> None:
            began = time.monotonic()
            try:
                answers.put((index, True, call(replica.engine, mine), time.monotonic() - began))
            except BaseException as error:  # noqa: BLE001 - handed to the waiting sample
                answers.put((index, False, error, 0.0))
            finally:
                with self.lock:
                    replica.in_flight -= 1

        threading.Thread(target=attempt, name="served-teacher-replica", daemon=True).start()
        return True

    def choose(self, asked: set[int], prompt: Hashable | None) -> int | None:
        """The healthy replica (not in `asked`) with the fewest requests in flight, or the prompt
        group's own (`keep_prompt_groups`); its count taken up."""
        n = len(self.replicas)
        with self.lock:
            healthy = [i for i in range(n) if i not in self.out and i not in asked]
            if not healthy:
                return None
            home = self.homes.get(prompt) if prompt is not None else None
            if home in healthy:
                index = home
            else:
                index = min(healthy, key=lambda i: (self.replicas[i].in_flight, (i - self.turn) % n))
                self.turn += 1
                if prompt is not None and self.settings.keep_prompt_groups:
                    self.homes[prompt] = index
            self.replicas[index].in_flight += 1
            return index

    def hedge_due(self, live: dict[int, tuple[AttemptCancel, float]]) -> bool:
        """Whether the sample's latest request has waited past the hedging point."""
        after = self.settings.hedge_after
        if after is None or not live:
            return False
        with self.lock:
            if not self.times or len(self.out) + len(live) >= len(self.replicas):
                return False
            point = max(self.settings.hedge_floor_s, after * statistics.median(self.times))
        return time.monotonic() - max(sent for _, sent in live.values()) >= point

    @staticmethod
    def drop(live: dict[int, tuple[AttemptCancel, float]]) -> None:
        """Cancel the sample's other requests (their replies dropped, no retry)."""
        for mine, _ in live.values():
            mine.set()
        live.clear()

    def all_failed(self, sample: int) -> ServedTeacherError:
        """The sample's error once every replica is out: the one replica's own error, as a single
        server's always was; with several, every replica's."""
        with self.lock:
            errors = [self.out[i] for i in sorted(self.out)]
        if len(self.replicas) == 1 and errors:
            error = errors[0]
            return error if isinstance(error, ServedTeacherError) else ServedTeacherError(str(error), self.url, sample)
        said = "; ".join(str(error) for error in errors)  # each names its replica's URL
        return ServedTeacherError(f"{self.url} (sample {sample}): every one of the teacher's {len(self.replicas)} "
                                  f"replicas failed this step (each is asked again next step): {said}",
                                  self.url, sample)
