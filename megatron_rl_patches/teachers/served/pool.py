"""A served teacher's replicas as one endpoint (`ReplicaPool`): one endpoint per URL (`server.Server`;
one URL is a pool of one), checked at connect as one teacher and asked through the scheduler
(`scheduler.Scheduler`: spreading, failover, hedging, across steps). The engines stay a request body
and a parsed reply; everything about several servers lives here. How the pool behaves is
`settings.ReplicaSettings`.

At connect every replica is asked (in order) for its served model: the engine's checks on each (K
within its limit; with a head, states of the head's width) and its answer to the engine's fixed
probe. The replicas that answer are one teacher by what they compute (`identity`: the probe's
answers within the engine's tolerance, the same max model length), whatever path they were started
from; one that differs from the first that answered is refused naming it. One that does not
answer is left out, named in one warning, and asked again between steps (`recheck`: its card and
the probe again, compared with the first's) — as is a replica taken out during a step, and every
replica in use `ReplicaSettings.recheck_s` after its last check (a server restarted with other
weights behind its URL is taken out, named in a warning); at least `min_replicas` must answer at
connect."""
from __future__ import annotations

import concurrent.futures as futures
import logging
import threading
from collections.abc import Sequence

from megatron_rl_patches.teachers.errors import ServedTeacherError, ServedTeacherRefusal
from megatron_rl_patches.teachers.redaction import redacted, scrubbed
from megatron_rl_patches.teachers.replica_urls import SEPARATOR
from megatron_rl_patches.teachers.served.cancel import Cancel
from megatron_rl_patches.teachers.served.endpoint import Endpoint, SampleAsk, Step
from megatron_rl_patches.teachers.served.engines.protocol import ServedModel
from megatron_rl_patches.teachers.served.http import Deadline
from megatron_rl_patches.teachers.served.identity import difference
from megatron_rl_patches.teachers.served.metrics import Recorder
from megatron_rl_patches.teachers.served.scheduler import Scheduler
from megatron_rl_patches.teachers.served.settings import ReplicaSettings

LOG = logging.getLogger(__name__)
SAME = ("the replicas of one teacher compute the same (the same checkpoint, dtype and max model length); serve it "
        "the same, or take it out of the teacher's URLs")


class ReplicaPool:
    """The `replicas` (endpoints of one kind) of one teacher, scheduled by `settings`; its `url`
    their URLs joined by '|'."""

    def __init__(self, replicas: Sequence[Endpoint], settings: ReplicaSettings,
                 recorder: Recorder | None = None) -> None:
        self.replicas = list(replicas)
        self.settings = settings
        self.url = SEPARATOR.join(replica.url for replica in self.replicas)
        self.kind = self.replicas[0].kind
        self.tokenize_path = self.replicas[0].tokenize_path
        self.recorder = recorder or Recorder()  # what the replicas did, for the teacher's metrics
        self.scheduler = Scheduler(self.replicas, settings, self.url, self.recheck, self.recorder)
        self.reference: tuple[int, ServedModel] | None = None  # the first replica that answered at connect
        self.checks: futures.ThreadPoolExecutor | None = None
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.replicas)

    # ------------------------------------------------------------------ connect
    def served_model(self, deadline: Deadline, cancel: threading.Event) -> ServedModel:
        """The teacher's served model (see the module's words)."""
        models: dict[int, ServedModel] = {}
        errors: dict[int, ServedTeacherError] = {}
        for index, replica in enumerate(self.replicas):
            try:
                models[index] = replica.served_model(deadline, cancel)
            except ServedTeacherRefusal:
                raise  # the server answered and refuses what is asked: the configuration's fault
            except ServedTeacherError as error:
                errors[index] = error
        if len(models) < self.settings.min_replicas:
            if len(self.replicas) == 1:
                raise errors[0]  # one server: its own error, as always
            said = "; ".join(str(errors[i]) for i in sorted(errors))  # each names its replica's URL
            raise ServedTeacherError(f"{redacted(self.url)}: {len(models)} of the teacher's {len(self.replicas)} "
                                     f"replicas answered at connect, fewer than ReplicaSettings(min_replicas="
                                     f"{self.settings.min_replicas}): {said}", self.url)
        first = min(models)
        for index in sorted(models)[1:]:
            problem = self.problem(first, models[first], index, models[index])
            if problem is not None:
                raise ServedTeacherRefusal(f"{problem}: {SAME}", self.url)
        self.reference = (first, models[first])
        self.scheduler.connected(models, errors)
        for index in sorted(errors):
            self.recorder.took_out(self.replicas[index].url)
        if errors:
            LOG.warning("served teacher %s: %d of the teacher's %d replicas did not answer at connect; it starts with "
                        "the others and asks these again between steps: %s", redacted(self.url), len(errors),
                        len(self.replicas), "; ".join(str(errors[i]) for i in sorted(errors)))
        return models[first]

    def problem(self, first: int, reference: ServedModel, index: int, model: ServedModel) -> str | None:
        """How replica `index` differs from replica `first` (None: one teacher), in words."""
        differs = difference(self.kind, reference, model)
        if differs is None:
            return None
        return f"replica {redacted(self.replicas[index].url)} " + \
            differs.replace("{reference}", redacted(self.replicas[first].url))

    def tokenize(self, model: ServedModel, text: str, deadline: Deadline, cancel: threading.Event) -> list[int] | None:
        """`text` tokenized by every replica in use: the same ids from each, or refused naming the
        one that differs."""
        usable = [self.replicas[i] for i in self.scheduler.usable_now()]
        first = usable[0]
        ids = first.tokenize(model, text, deadline, cancel)
        for replica in usable[1:]:
            other = replica.tokenize(model, text, deadline, cancel)
            if other != ids:
                raise ServedTeacherRefusal(
                    f"replica {redacted(replica.url)} tokenizes a probe text into other ids than replica "
                    f"{redacted(first.url)} ({'no tokens' if other is None else f'{len(other)} ids'} against "
                    f"{'no tokens' if ids is None else f'{len(ids)}'}): the replicas of one teacher serve the same "
                    f"tokenizer; serve it the same, or take it out of the teacher's URLs", self.url)
        return ids

    # ------------------------------------------------------------------ a step
    def ask(self, model: ServedModel, sample: SampleAsk, step: Step) -> futures.Future:
        return self.scheduler.ask(model, sample, step)

    def recheck(self, index: int, step: Step, in_use: bool) -> None:
        """Replica `index` (`in_use`: not out, its check due) asked again in the background (its card
        and probe), within the step's deadline; the scheduler told the outcome."""
        with self.lock:
            if self.checks is None:
                self.checks = futures.ThreadPoolExecutor(len(self.replicas), thread_name_prefix="served-teacher-check")
            checks = self.checks
        checks.submit(self.check_again, index, step.deadline, in_use)

    def check_again(self, index: int, deadline: Deadline, in_use: bool) -> None:
        replica = self.replicas[index]
        try:
            model = replica.served_model(deadline, Cancel())
        except Exception as failed:  # noqa: BLE001 - out: asked again next step
            self.scheduler.rejoin(index, None, failed)
            return
        problem = None if self.reference is None else self.problem(*self.reference, index, model)
        if problem is None:
            self.scheduler.rejoin(index, model, None)
            return
        if self.scheduler.new_reason(index, problem):  # one line per reason, not one per re-check
            LOG.warning("served teacher %s: %s: %s (asked again next step); %s", redacted(self.url), scrubbed(problem),
                        "taken out" if in_use else "kept out", SAME)
        self.scheduler.rejoin(index, None, ServedTeacherRefusal(f"{problem}: {SAME}", self.url))

    def close(self) -> None:
        self.scheduler.close()
        with self.lock:
            checks, self.checks = self.checks, None
        if checks is not None:
            checks.shutdown(wait=False, cancel_futures=True)
        for replica in self.replicas:
            replica.close()
