"""The replicas' scheduler (`Scheduler`): each sample sent to a healthy replica the spreading policy
picks (`ReplicaSettings.spread`); a replica that fails (refused at connection, reset, a 5xx after
the client's retries, a read timeout) is taken out, its other requests stop retrying there, and the
sample is re-sent to another; a request past the hedging point is sent again to another replica,
the first answer winning and the other cancelled. A request that fails is its replica failing
whoever answered its sample (a dead replica's request, in the client's retries when the hedge
answered, fails as they stop: taken out, counted failed over, named). The sample fails only when
every replica has failed (or the deadline passed); a 4xx refusal is the request's, raised as it is.
A replica out is named in a warning once per reason it is out (failing; refused again for another
reason) and once when it is back, not at every re-check.

It remembers across steps: a replica taken out (or down at connect) stays out until it is
re-checked — at the first sample of the next step, in the background (`recheck`: its card and the
probe, compared with the teacher's), the step's samples going to the others meanwhile or waiting
for it where none is left; a replica in use is checked so too at the first step
`ReplicaSettings.recheck_s` after its last check (a server restarted with other weights behind its
URL), sent no sample of that step until its check is back; the hedging point is `hedge_after`
times the median of the replicas' latest answer times (at least `hedge_floor_s`; before any
answer, only to an idle replica); ties of requests in flight go round the replicas from step to
step.

Nothing polls: a request's answer completes its future, whose callback moves the sample on; one
watcher thread per pool sleeps until the next hedging point or deadline of a sample in flight (or
until something changes)."""
from __future__ import annotations

import concurrent.futures as futures
import logging
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rl_patches.teachers.errors import ServedTeacherError, ServedTeacherRefusal, ServedTeacherStopped
from megatron_rl_patches.teachers.redaction import redacted
from megatron_rl_patches.teachers.served.endpoint import Endpoint, SampleAsk, Step
from megatron_rl_patches.teachers.served.engines.protocol import ServedModel
from megatron_rl_patches.teachers.served.metrics import Recorder
from megatron_rl_patches.teachers.served.settings import ReplicaSettings
from megatron_rl_patches.teachers.served.spreading import FewestInFlight, Placements, PromptAffinity

LOG = logging.getLogger(__name__)
HISTORY = 64  # the latest answer times the hedging point is read from
FAILING = "failing"  # why a replica is out when it failed (its card, probe or a request): not its computing


@dataclass
class StepState:
    """What one step saw: the replicas it took out (each named once in a warning)."""

    taken_out: set[int] = field(default_factory=set)


@dataclass(eq=False)
class Attempt:
    """One request of a sample to one replica: its own cancel (`step.cancel`), when it was sent."""

    replica: int
    step: Step
    hedge: bool = False
    sent: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class Job:
    """One sample over the replicas: its requests in flight (replica -> attempt) and its future."""

    model: ServedModel
    sample: SampleAsk
    step: Step
    state: StepState
    future: futures.Future = field(default_factory=futures.Future)
    live: dict[int, Attempt] = field(default_factory=dict)
    done: bool = False
    answered: bool = False  # done with an answer (not an error)
    moved: bool = False  # counted as failed over once, for a request that failed while another had it


class Scheduler:
    """The samples of a teacher's steps over its `replicas` (endpoints), as `settings` says;
    `recheck(replica, step, in_use)` re-checks a replica (out, or in use: `in_use`; its outcome comes
    back by `rejoin`);
    what it does is counted in `recorder`."""

    def __init__(self, replicas: Sequence[Endpoint], settings: ReplicaSettings, url: str,
                 recheck: Callable[[int, Step, bool], None], recorder: Recorder) -> None:
        self.replicas, self.settings, self.url, self.recheck = list(replicas), settings, url, recheck
        self.recorder = recorder
        self.spread = settings.spread or FewestInFlight()  # ReplicaSettings resolves it: never None there
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # the watcher's wake-up
        n = len(self.replicas)
        self.in_flight = [0] * n
        self.attempts: list[set[Attempt]] = [set() for _ in range(n)]  # each replica's requests in flight
        self.models: list[ServedModel | None] = [None] * n  # each replica's own served model (the name it is asked by)
        self.out: dict[int, BaseException] = {}  # replicas taken out (or down at connect), with their latest error
        self.said: dict[int, str] = {}  # why each replica out was last named in a warning (one line per reason)
        self.checking: set[int] = set()  # replicas being re-checked now (out, or in use and due): sent no sample
        self.checked = [time.monotonic()] * n  # when each replica's card and probe were last asked
        self.history: deque[float] = deque(maxlen=HISTORY)
        self.median = 0.0
        self.placements = Placements()
        self.steps: weakref.WeakKeyDictionary[Step, StepState] = weakref.WeakKeyDictionary()
        self.jobs: set[Job] = set()
        self.waiting: list[Job] = []  # samples with no replica to go to while some are re-checked
        self.watcher: threading.Thread | None = None
        self.closed = False

    def connected(self, models: Mapping[int, ServedModel], errors: Mapping[int, BaseException]) -> None:
        """The replicas' served models at connect, and those that did not answer (out until re-checked)."""
        with self.lock:
            for index, model in models.items():
                self.models[index] = model
                self.out.pop(index, None)
                self.said.pop(index, None)
            self.out.update(errors)
            self.said.update(dict.fromkeys(errors, FAILING))  # the pool's one warning at connect names them
            self.checked = [time.monotonic()] * len(self.replicas)
            if not self.settings.spread_given and models and all(model.shares_prefix for model in models.values()):
                self.spread = PromptAffinity()  # serve-teacher replicas: a group's prompt computed once, on one

    def usable(self) -> list[int]:
        """The replicas samples may go to now: neither out nor being checked (holding the lock)."""
        return [i for i in range(len(self.replicas)) if i not in self.out and i not in self.checking]

    def to_check(self) -> list[tuple[int, bool]]:
        """The replicas to check at the start of a step, marked as being checked (holding the lock):
        each one out, and each in use whose last check is `recheck_s` old (several replicas only);
        (index, whether it is in use)."""
        every = self.settings.recheck_s
        now = time.monotonic()
        due = [(i, i not in self.out) for i in range(len(self.replicas)) if i not in self.checking and (
            i in self.out or (every is not None and len(self.replicas) > 1 and now - self.checked[i] >= every))]
        for index, _ in due:
            self.checking.add(index)
            self.checked[index] = now
        return due

    def usable_now(self) -> list[int]:
        """The replicas not out, those being checked included (a text to tokenize may go there)."""
        with self.lock:
            return [i for i in range(len(self.replicas)) if i not in self.out]

    # ------------------------------------------------------------------ a sample in
    def ask(self, model: ServedModel, sample: SampleAsk, step: Step) -> futures.Future:
        """The sample's future (see the module's words)."""
        checks: list[tuple[int, bool]] = []
        with self.lock:
            state = self.steps.get(step)
            if state is None:  # a new step: the replicas out (or due) are asked again, before any sample goes there
                state = self.steps[step] = StepState()
                self.placements.homes.clear()
                checks = self.to_check()
            job = Job(model, sample, step, state)
            self.jobs.add(job)
            attempt = self.reserve(job, sample.prompt)
            waits = attempt is None and bool(self.checking)
            if waits:
                self.waiting.append(job)
            failure = self.all_failed(job) if attempt is None and not waits else None
            self.watch()
        for index, in_use in checks:
            self.recheck(index, step, in_use)
        step.cancel.on_set(lambda: self.cancelled(job))
        if attempt is not None:
            self.send(job, attempt)
        elif failure is not None:
            self.finish(job, failure, None)
        return job.future

    def reserve(self, job: Job, prompt: tuple[int, ...] | None, hedge: bool = False) -> Attempt | None:
        """A request of `job` on a healthy replica not asked for it now, its count taken up (None:
        there is none); holding the lock."""
        loads = {i: self.in_flight[i] for i in self.usable() if i not in job.live}
        if not loads:
            return None
        index = self.spread.choose(loads, len(self.replicas), prompt, self.placements)
        attempt = Attempt(index, job.step.child(), hedge)
        job.live[index] = attempt
        self.in_flight[index] += 1
        self.attempts[index].add(attempt)
        self.changed.notify_all()
        return attempt

    def send(self, job: Job, attempt: Attempt) -> None:
        model = self.models[attempt.replica] or job.model
        future = self.replicas[attempt.replica].ask(model, job.sample, attempt.step)
        future.add_done_callback(lambda done: self.answered(job, attempt, done))

    # ------------------------------------------------------------------ a request out
    def answered(self, job: Job, attempt: Attempt, done: futures.Future) -> None:
        """A request's answer or failure: the sample answered, failed, or sent on. A request that
        fails is its replica failing even where the sample was answered by another (a hedge that
        answered first stopped its retries): taken out, counted, named."""
        seconds = time.monotonic() - attempt.sent
        error = done.exception()
        index = attempt.replica
        # a refusal is the request's; a request stopped unsent because its sample was answered elsewhere (queued
        # there as a hedge's loser) says nothing of its replica
        failing = isinstance(error, ServedTeacherError) and not isinstance(error, ServedTeacherRefusal) and \
            not (isinstance(error, ServedTeacherStopped) and job.answered)
        stopped: list[Attempt] = []
        resend = None
        warn = failed_over = False
        ended: tuple[BaseException | None, Any] | None = None
        with self.lock:
            self.in_flight[index] -= 1
            self.attempts[index].discard(attempt)
            if job.live.get(index) is attempt:
                del job.live[index]
            if job.done and not (failing and job.answered and not self.closed and not job.step.cancel.is_set()):
                return
            if error is None:
                self.history.append(seconds)
                self.median = statistics.median(self.history)
                ended = (None, done.result())
            elif not failing:
                ended = (error, None)
            else:
                if not job.step.cancel.is_set() and index not in self.out:
                    self.out[index] = error
                    self.said[index] = FAILING
                    stopped = list(self.attempts[index])  # no more retries there
                    warn = index not in job.state.taken_out
                    job.state.taken_out.add(index)
                if job.done or job.live:  # answered by another replica, or asked of one now (a hedge)
                    failed_over = not job.moved
                    job.moved = True
                else:
                    resend = self.reserve(job, job.sample.prompt)
                    failed_over = resend is None and bool(self.checking)
                    if failed_over:
                        self.waiting.append(job)
                    elif resend is None:
                        ended = (self.all_failed(job), None)
            self.changed.notify_all()
        url = self.replicas[index].url
        if error is None:
            self.recorder.answered(url, seconds)
        else:
            self.recorder.failed(url)
        if ended is not None and ended[0] is None:
            self.recorder.add("samples")
            self.recorder.add("rows", len(job.sample.ids) - job.sample.start)
            self.recorder.add("hedges_won", int(attempt.hedge))
        if resend is not None or failed_over:
            self.recorder.add("failovers")
        if warn:
            self.recorder.took_out(url)
            LOG.warning("served teacher %s: replica %s taken out (%s); its samples go to the others, and it is asked "
                        "again next step", redacted(self.url), redacted(self.replicas[index].url), error)
        for other in stopped:
            other.step.cancel.set()
        if ended is not None:
            self.finish(job, *ended)
        elif resend is not None:
            self.send(job, resend)

    def finish(self, job: Job, error: BaseException | None, answer: Any) -> None:
        """The sample answered (or failed), once: its other requests cancelled, its future completed."""
        with self.lock:
            if job.done:
                return
            job.done = True
            job.answered = error is None
            self.jobs.discard(job)
            if job in self.waiting:
                self.waiting.remove(job)
            others = list(job.live.values())
            self.changed.notify_all()
        for other in others:
            other.step.cancel.set()
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(answer)

    def cancelled(self, job: Job) -> None:
        """The step failed: the sample ends now."""
        if not job.done:
            index = job.sample.index
            self.finish(job, ServedTeacherError(f"{self.url}: sample {index} not answered: the step failed before",
                                                self.url, index), None)

    def all_failed(self, job: Job) -> ServedTeacherError:
        """The sample's error once every replica is out: with one replica its own error, as a single
        server's always was; with several, every replica's (holding the lock)."""
        sample = job.sample.index
        errors = [self.out[i] for i in sorted(self.out)]
        if len(self.replicas) == 1 and errors:
            error = errors[0]
            return error if isinstance(error, ServedTeacherError) else ServedTeacherError(str(error), self.url, sample)
        said = "; ".join(str(error) for error in errors)  # each names its replica's URL
        return ServedTeacherError(f"{self.url} (sample {sample}): every one of the teacher's {len(self.replicas)} "
                                  f"replicas failed this step (each is asked again next step): {said}",
                                  self.url, sample)

    # ------------------------------------------------------------------ a replica re-checked
    def rejoin(self, index: int, model: ServedModel | None, error: BaseException | None) -> None:
        """A re-check's outcome: the replica back in (its waiting samples sent), or out; one that was
        in use and is out now is counted. Warned of once per reason it is out (failing: here; a
        refusal is the pool's to word, `new_reason`), and once when it is back, not at every re-check."""
        sent: list[tuple[Job, Attempt]] = []
        failed: list[tuple[Job, ServedTeacherError]] = []
        with self.lock:
            self.checking.discard(index)
            taken_out = error is not None and index not in self.out
            back = error is None and index in self.out
            failing = error is not None and not isinstance(error, ServedTeacherRefusal)
            said = failing and self.said.get(index) != FAILING
            if error is None:
                self.out.pop(index, None)
                self.said.pop(index, None)
                self.models[index] = model
            else:
                self.out[index] = error
                if failing:
                    self.said[index] = FAILING
            waiting, self.waiting = self.waiting, []
            for job in waiting:
                attempt = None if job.done else self.reserve(job, job.sample.prompt)
                if attempt is not None:
                    sent.append((job, attempt))
                elif not job.done and self.checking:
                    self.waiting.append(job)
                elif not job.done:
                    failed.append((job, self.all_failed(job)))
            self.changed.notify_all()
        url = self.replicas[index].url
        if taken_out:
            self.recorder.took_out(url)
        if said:
            LOG.warning("served teacher %s: replica %s %s at its re-check (%s); its samples go to the others, and it "
                        "is asked again next step", redacted(self.url), redacted(url),
                        "taken out" if taken_out else "kept out", error)
        if back:
            LOG.warning("served teacher %s: replica %s is back (its card and probe as the teacher's): samples go to it "
                        "again", redacted(self.url), redacted(url))
        for job, attempt in sent:
            self.send(job, attempt)
        for job, failure in failed:
            self.finish(job, failure, None)

    def new_reason(self, index: int, reason: str) -> bool:
        """Whether `reason` (why replica `index` is out now) is not the one it was last named for,
        remembered as named: the caller words the warning."""
        with self.lock:
            fresh = self.said.get(index) != reason
            self.said[index] = reason
            return fresh

    # ------------------------------------------------------------------ hedging and the deadline
    def hedge_at(self, job: Job) -> float | None:
        """When the sample's latest request is due a hedge (None: not now); holding the lock."""
        after = self.settings.hedge_after
        if after is None or not job.live:
            return None
        others = [i for i in self.usable() if i not in job.live]
        if not others:
            return None
        if self.history:
            point = max(self.settings.hedge_floor_s, after * self.median)
        elif any(self.in_flight[i] == 0 for i in others):  # no answer yet: only to a replica with nothing to do
            point = self.settings.hedge_floor_s
        else:
            return None
        return max(attempt.sent for attempt in job.live.values()) + point

    def watch(self) -> None:
        """The watcher thread started (holding the lock)."""
        if self.watcher is None or not self.watcher.is_alive():
            self.closed = False
            self.watcher = threading.Thread(target=self.watching, name="served-teacher-replicas", daemon=True)
            self.watcher.start()

    def watching(self) -> None:
        while True:
            with self.changed:
                if self.closed:
                    return
                now = time.monotonic()
                due, wake = [], None
                for job in self.jobs:
                    hedge = self.hedge_at(job)
                    at = job.step.deadline.at if hedge is None else min(hedge, job.step.deadline.at)
                    if at <= now:
                        due.append(job)
                    else:
                        wake = at if wake is None else min(wake, at)
                if not due:
                    self.changed.wait(None if wake is None else wake - now)
                    continue
            for job in due:
                self.due(job)

    def due(self, job: Job) -> None:
        """A sample at its deadline fails naming the replicas asked; one at its hedging point is sent
        again to another replica."""
        with self.lock:
            if job.done:
                return
            now = time.monotonic()
            late = now >= job.step.deadline.at
            hedge = None
            if late:
                asked = ", ".join(redacted(self.replicas[i].url) for i in job.live)
            else:
                at = self.hedge_at(job)
                if at is None or at > now:
                    return
                hedge = self.reserve(job, None, hedge=True)
        if late:
            sample, deadline = job.sample.index, job.step.deadline
            self.finish(job, ServedTeacherError(f"{self.url} (sample {sample}): no reply within the step's deadline "
                                                f"of {deadline.seconds:g} s (asked: {asked or 'none'})", self.url,
                                                sample), None)
        elif hedge is not None:
            self.recorder.add("hedges_sent")
            self.send(job, hedge)

    def close(self) -> None:
        """Stop the watcher."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()
