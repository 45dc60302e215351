"""Endpoints in memory for the replicas' scheduler's tests (fast, deterministic; beside the HTTP
stand-ins of tests/teachers/local_servers.py and the served lane's real servers): each answers a
sample with rows computed from its ids (`rows_of`, shifted by `offset`: another checkpoint's),
at once, after `delay` seconds, when released by hand (`hold`), or fails as `fails` says; with
`retrying` a request ends at once when its cancel is set (the client's retries stopped: a dead
server's request, in its backoff, fails then)."""
from __future__ import annotations

import concurrent.futures as futures
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.teachers import ServedTeacherError
from megatron_rl_patches.teachers.served.endpoint import SampleAsk, Step
from megatron_rl_patches.teachers.served.engines.protocol import ROWS, SampleRows, ServedModel

MODEL = ServedModel("m", 64)
PROBE = [0, 0]  # the engines' fixed probe


def failing(url: str) -> Callable[[SampleAsk], ServedTeacherError]:
    """A replica that does not answer (connection refused after the client's retries)."""
    return lambda sample: ServedTeacherError(f"{url}/v1/completions: no answer after 2 tries (ConnectError)", url,
                                             sample.index)


def rows_of(ids: list[int], start: int, offset: float = 0.0) -> SampleRows:
    """Two buckets per row at log 1/2 and log 1/4 (plus `offset`), the actual id's log-prob its id / -10."""
    rows = len(ids) - start
    values = torch.tensor([[-0.6931 + offset, -1.3863 + offset]] * rows, dtype=torch.float64)
    token = torch.tensor([-ids[start + r] / 10 + offset for r in range(rows)], dtype=torch.float64)
    return SampleRows(token, torch.tensor([[0, 1]] * rows), values, torch.full((rows,), -1.3863, dtype=torch.float64))


class MemoryEndpoint:
    """One replica in memory at `url` (see the module's words); `asked` lists the sample index of
    every request it got, `cancels` each request's cancel."""

    kind = ROWS
    tokenize_path = "/tokenize"

    def __init__(self, url: str, *, delay: float = 0.0, hold: bool = False, offset: float = 0.0,
                 fails: Callable[[SampleAsk], BaseException | None] | None = None,
                 model: ServedModel = MODEL, retrying: bool = False) -> None:
        self.url, self.delay, self.hold, self.offset, self.fails, self.model = url, delay, hold, offset, fails, model
        self.retrying = retrying
        self.asked: list[int | None] = []
        self.checks = 0  # served_model calls: at connect, and each re-check
        self.cancels: list[threading.Event] = []
        self.held: list[tuple[futures.Future, SampleAsk]] = []
        self.lock = threading.Lock()
        self.closed = False

    def served_model(self, deadline: Any, cancel: threading.Event) -> ServedModel:
        """The card and the probe's answer (or the replica's failure, as `fails` says)."""
        self.checks += 1
        failure = self.fails(SampleAsk(PROBE, 1, None)) if self.fails is not None else None
        if failure is not None:
            raise failure
        if "answer" not in {f.name for f in dataclasses.fields(ServedModel)}:
            return self.model
        return dataclasses.replace(self.model, answer=rows_of(PROBE, 1, self.offset))

    def tokenize(self, model: ServedModel, text: str, deadline: Any, cancel: threading.Event) -> list[int] | None:
        return [int(word[1:]) for word in text.split()]

    def ask(self, model: ServedModel, sample: SampleAsk, step: Step) -> futures.Future:
        future: futures.Future = futures.Future()
        with self.lock:
            self.asked.append(sample.index)
            self.cancels.append(step.cancel)
            if self.hold:
                self.held.append((future, sample))
                return future
        if self.delay:
            threading.Timer(self.delay, self.answer, (future, sample)).start()
            if self.retrying:
                step.cancel.on_set(lambda: self.answer(future, sample))
        else:
            self.answer(future, sample)
        return future

    def answer(self, future: futures.Future, sample: SampleAsk) -> None:
        failure = self.fails(sample) if self.fails is not None else None
        with self.lock:  # once: a retrying request ends at its cancel or its delay, whichever is first
            if future.running() or future.done():
                return
            future.set_running_or_notify_cancel()
        if failure is not None:
            future.set_exception(failure)
        else:
            future.set_result(rows_of(sample.ids, sample.start, self.offset))

    def release(self) -> None:
        """Answer every held request now (and those to come)."""
        with self.lock:
            held, self.held, self.hold = self.held, [], False
        for future, sample in held:
            self.answer(future, sample)

    def close(self) -> None:
        self.closed = True
