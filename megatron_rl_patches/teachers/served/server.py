"""One URL's engine as an endpoint (`Server`): at most `max_in_flight` requests and
`max_tokens_in_flight` prompt tokens at once on that server (the others wait their turn, in
order); each request runs on a thread of the server's own and completes its sample's future."""
from __future__ import annotations

import concurrent.futures as futures
import threading
from collections import deque
from typing import Any

from megatron_rl_patches.teachers.errors import ServedTeacherError, ServedTeacherStopped
from megatron_rl_patches.teachers.served.budget import TokenBudget
from megatron_rl_patches.teachers.served.endpoint import SampleAsk, Step
from megatron_rl_patches.teachers.served.engines.protocol import ServedEngine, ServedModel
from megatron_rl_patches.teachers.served.http import Deadline
from megatron_rl_patches.teachers.served.settings import ClientSettings

Request = tuple[ServedModel, SampleAsk, Step, futures.Future]


class Server:
    """`engine` (its client at one URL) answering as an `Endpoint`, bounded by `settings`."""

    def __init__(self, engine: ServedEngine, settings: ClientSettings) -> None:
        self.engine = engine
        self.url: str = engine.client.url
        self.kind: str = engine.kind
        self.tokenize_path: str = engine.tokenize_path
        self.settings = settings
        self.budget = TokenBudget(settings.max_tokens_in_flight)
        self.waiting: deque[Request] = deque()
        self.running = 0
        self.lock = threading.Lock()
        self.threads: futures.ThreadPoolExecutor | None = None
        self.closed = False  # close(): no thread is started again (a failover to a closed server fails)

    def served_model(self, deadline: Deadline, cancel: threading.Event) -> ServedModel:
        return self.engine.served_model(deadline, cancel)

    def tokenize(self, model: ServedModel, text: str, deadline: Deadline, cancel: threading.Event) -> list[int] | None:
        return self.engine.tokenize(model, text, deadline, cancel)

    def ask(self, model: ServedModel, sample: SampleAsk, step: Step) -> futures.Future:
        """The sample asked once room is free (see the module's words)."""
        future: futures.Future = futures.Future()
        with self.lock:
            self.waiting.append((model, sample, step, future))
            started = self.admitted()
        self.start(started)
        return future

    def admitted(self) -> list[Request]:
        """The waiting requests that fit now, in order (called holding the lock)."""
        started = []
        while self.waiting and self.running < self.settings.max_in_flight and \
                self.budget.take(len(self.waiting[0][1].ids)):
            started.append(self.waiting.popleft())
            self.running += 1
        return started

    def start(self, requests: list[Request]) -> None:
        for request in requests:
            try:
                self.pool().submit(self.run, *request)
            except ServedTeacherError as closed:  # closed before this request got a thread
                self.done(request, closed, None)
            except RuntimeError:  # closed between pool() and submit(): the executor's own words
                index = request[1].index
                self.done(request, ServedTeacherError(f"{self.url}: sample {index} not sent: the teacher was closed",
                                                      self.url, index), None)

    def run(self, model: ServedModel, sample: SampleAsk, step: Step, future: futures.Future) -> None:
        error: BaseException | None = None
        answer = None
        try:
            if step.cancel.is_set():
                raise ServedTeacherStopped(f"{self.url}: sample {sample.index} not sent: answered elsewhere or the "
                                           f"step failed before", self.url, sample.index)
            if step.deadline.remaining() <= 0:
                raise ServedTeacherError(f"{self.url}: sample {sample.index} waited for tokens in flight past the "
                                         f"step's deadline of {step.deadline.seconds:g} s", self.url, sample.index)
            answer = self.engine.ask(model, sample.ids, sample.start, step.deadline, step.cancel, sample.index)
        except BaseException as failed:  # noqa: BLE001 - the sample's future carries it
            error = failed
        self.done((model, sample, step, future), error, answer)

    def done(self, request: Request, error: BaseException | None, answer: Any) -> None:
        """The request's room given to the next ones, then its future completed."""
        _, sample, _, future = request
        with self.lock:
            self.running -= 1
            self.budget.release(len(sample.ids))
            started = self.admitted()
        self.start(started)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(answer)

    def pool(self) -> futures.ThreadPoolExecutor:
        with self.lock:
            if self.closed:
                raise ServedTeacherError(f"{self.url}: the teacher was closed", self.url)
            if self.threads is None:
                self.threads = futures.ThreadPoolExecutor(self.settings.max_in_flight,
                                                          thread_name_prefix="served-teacher")
            return self.threads

    def close(self) -> None:
        """Stop the threads (the requests waiting for room fail) and close the connections."""
        with self.lock:
            self.closed = True
            threads, self.threads = self.threads, None
            waiting, self.waiting = list(self.waiting), deque()
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)
        for _, sample, _, future in waiting:
            future.set_exception(ServedTeacherError(f"{self.url}: sample {sample.index} not sent: the teacher was "
                                                    f"closed", self.url, sample.index))
        self.engine.client.close()
