"""A teacher served by an inference engine (`ServedTeacher`): its own top-k with the exact tail
for every response row of a `TeacherBatch` (or, with its head on the trainer, its hidden states
through the head: the two routes, one object each, `routes.py`), asked over HTTP at its
`ScoringPlan`. It holds one endpoint (`endpoint.Endpoint`: its replicas as a `pool.ReplicaPool`,
one URL a pool of one): a step's samples in flight at once (bounded in requests and tokens per
server), within one deadline; `PendingScores` collects them."""
from __future__ import annotations

import concurrent.futures as futures
import os
import threading
from typing import Any

import torch

from megatron_rl_patches.ops.scoring_plan import Planned, ScoringPlan, scoring_plan
from megatron_rl_patches.teachers.agreement import agree_failure, agree_teacher
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.context.key import context_key
from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.errors import ServedTeacherError, ServedTeacherRefusal
from megatron_rl_patches.teachers.finite import utf8_text
from megatron_rl_patches.teachers.head.teacher_head import TeacherHead
from megatron_rl_patches.teachers.replica_urls import SEPARATOR, replica_urls
from megatron_rl_patches.teachers.served.endpoint import Endpoint, SampleAsk, Step
from megatron_rl_patches.teachers.served.engines.names import check_engine
from megatron_rl_patches.teachers.served.engines.protocol import ServedEngine, ServedModel
from megatron_rl_patches.teachers.served.http import Deadline, TeacherClient
from megatron_rl_patches.teachers.served.metrics import Recorder
from megatron_rl_patches.teachers.served.pool import ReplicaPool
from megatron_rl_patches.teachers.served.routes import Route, served_route
from megatron_rl_patches.teachers.served.server import Server
from megatron_rl_patches.teachers.served.settings import ClientSettings, ReplicaSettings


class ServedTeacher(Planned):
    """A teacher at `url` (http(s)://host:port) served by `engine`, scoring its own `top_k`
    buckets per row (default 20; K within the server's limit: vLLM's `--max-logprobs`, default 20).
    Engines score at temperature 1 whatever is asked: another `temperature` is refused. `plan`: a
    `ScoringPlan` in place of `top_k` and `temperature` (one or the other). `client` sets the
    timeouts, deadline, retries, bounds, API key variable and CA bundle (`ClientSettings`; the
    bounds in flight are each server's). `url` may name the teacher's replicas: a list of URLs
    (or one str of them joined by '|'), one teacher served the same by each; `replicas` says how
    a step spreads, fails over and hedges over them (`ReplicaSettings`).
    `head`: the teacher's output layer on the trainer (a `TeacherHead` or its checkpoint's
    directory): the server sends hidden states (in `hidden_dtype`), projected here at any K and
    temperature. `context`: the key of each sample's privileged context in the teacher step
    (`TeacherStep.send(batch, contexts={KEY: ...})`): it scores them before the student's response."""

    def __init__(self, url: str | list[str], engine: str = "vllm", top_k: int | None = None, *,
                 model: str | None = None, temperature: float | None = None, client: ClientSettings | None = None,
                 head: TeacherHead | str | os.PathLike[str] | None = None,
                 hidden_dtype: torch.dtype | None = None, context: str | None = None,
                 replicas: ReplicaSettings | None = None, plan: ScoringPlan | None = None) -> None:
        self.context = context_key(context, "ServedTeacher(context=...)")
        self.plan = scoring_plan(plan, top_k, temperature, "ServedTeacher", top_k_default=20)
        self.route: Route = served_route(head, engine, self.plan, hidden_dtype)  # its rows, or states through its head
        self.engine_name = check_engine(engine)
        if model is not None and not isinstance(model, str):
            raise TypeError(f"ServedTeacher(model=...) must be the served model's name (a str) or None, got "
                            f"{type(model).__name__}")
        if client is not None and not isinstance(client, ClientSettings):
            raise TypeError(f"ServedTeacher(client=...) must be a ClientSettings, got {type(client).__name__}")
        if replicas is not None and not isinstance(replicas, ReplicaSettings):
            raise TypeError(f"ServedTeacher(replicas=...) must be a ReplicaSettings, got {type(replicas).__name__}")
        self.settings = client or ClientSettings()
        self.model = model  # the served model's name to ask for (None: the one each server serves)
        urls = replica_urls(url)
        replicas = replicas or ReplicaSettings()
        if replicas.min_replicas > len(urls):
            raise ValueError(f"ServedTeacher(replicas=ReplicaSettings(min_replicas={replicas.min_replicas})): the url "
                             f"names {len(urls)} replicas; ask for at most {len(urls)} to answer at connect")
        self.recorder = Recorder()  # what it did since `metrics()` was last asked
        servers = [Server(self.engine_at(TeacherClient(one, self.settings, self.recorder)), self.settings)
                   for one in urls]
        self.endpoint: Endpoint = ReplicaPool(servers, replicas, self.recorder)
        self.url = self.endpoint.url
        self._served: ServedModel | None = None
        self._lock = threading.Lock()

    def engine_at(self, client: TeacherClient) -> ServedEngine:
        """The engine asking one server through `client`: rows, or with a head hidden states."""
        return self.route.engine(self.engine_name, client, self.model)

    @property
    def head(self) -> TeacherHead | None:
        """The teacher's output layer on the trainer (None: the engine sends its own rows)."""
        return self.route.head

    @head.setter
    def head(self, head: TeacherHead) -> None:
        """The head re-cut for the host (its checkpoint's rows, another padding: a host's
        `head_padded_as`); a teacher without a head takes none."""
        self.route = self.route.recut(head)

    @property
    def hidden_dtype(self) -> torch.dtype | None:
        """The dtype its hidden states travel in (None without a head)."""
        return self.route.hidden_dtype


    @property
    def tokenize_path(self) -> str:
        """The route its tokenizer is asked at (messages name it)."""
        return self.endpoint.tokenize_path

    @property
    def replicas(self) -> tuple[str, ...]:
        """The replicas' URLs (one URL: one replica)."""
        return tuple(self.url.split(SEPARATOR))

    def __repr__(self) -> str:
        return f"ServedTeacher({self.url!r}, engine={self.engine_name!r}, top_k={self.top_k})"

    # ------------------------------------------------------------------ the server
    def served_model(self, deadline: Deadline | None = None) -> ServedModel:
        """The served model (name, max model length), asked once; K checked against the server
        (each replica: the same model on all, or refused naming the one that differs)."""
        with self._lock:
            if self._served is None:
                self._served = self.endpoint.served_model(deadline or Deadline.after(self.settings.deadline_s),
                                                          threading.Event())
            return self._served

    def metrics(self) -> dict[str, Any]:
        """What the teacher did since the last call (a dashboard's step: call it once a step):
        `samples` and `rows` answered, `bytes` received, `retries` (the client's, on connection
        errors and 5xx), `failovers` (samples a failing replica's request
        left to another: re-sent after it failed, or answered by a hedge sent before), `hedges_sent` and
        `hedges_won`, `taken_out` (the replicas taken out, redacted URLs: one entry each time) and
        `replicas`: per replica (its redacted URL) its `requests`, `failed` and the answered
        requests' `latency_p50_s` / `latency_p95_s` (None without one). Counting starts again at zero."""
        return self.recorder.take()

    def check(self) -> ServedModel:
        """Ask the server now (it answers, the model, its max length, K within its limit)."""
        return self.served_model()

    def tokenize(self, text: str, deadline: Deadline | None = None) -> list[int] | None:
        """`text` tokenized by the served model's tokenizer, no special tokens added (None: the
        server answered with no token list), within `deadline` (default: one request's timeout);
        every replica asked (the same ids from each, or refused naming the one that differs)."""
        utf8_text(text, "ServedTeacher.tokenize(text=...)")  # a bare UnicodeEncodeError from the JSON body otherwise
        deadline = deadline or Deadline.after(self.settings.timeout_s)
        return self.endpoint.tokenize(self.served_model(deadline), text, deadline, threading.Event())

    # ------------------------------------------------------------------ scoring
    def score(self, batch: TeacherBatch, group: object = None, *, ids: list[torch.Tensor] | None = None) -> BatchScores:
        """Every sample of `batch` on its response rows (`BatchScores`). With a process `group`
        (torch.distributed initialized), a failure on any rank is the same error on every rank.
        With a head: `ids` (one [R_i, k] id tensor per sample, e.g. the student's top-k) are scored
        too (`BatchScores.ids_log_probs` / `ids_tail_log_probs`); every rank of the head's
        tensor-parallel group scores the same batch. The group's ranks must hold the same teacher
        (URLs, engine, top-k, temperature, head, context key): compared before anything is asked."""
        agree_teacher(self, group)
        return self.submit(batch, ids=ids).result(group)

    def submit(self, batch: TeacherBatch, *, ids: list[torch.Tensor] | None = None,
               samples: list[int] | None = None) -> PendingScores:
        """Send every sample now and return at once: `.result()` collects. Nothing raises here: a
        refusal or failure (the server asked first, a sample too long) comes out of `.result()`,
        where it is agreed over a group like any other. `samples`: the index each sample of `batch`
        is named by in those errors (a rollout asking for one sample: its index in the rollout);
        None: its place in `batch`."""
        step = Step.within(self.settings.deadline_s)
        try:
            if not isinstance(batch, TeacherBatch):
                raise TypeError(f"ServedTeacher.score(batch) takes a TeacherBatch, got {type(batch).__name__}")
            names = list(range(len(batch))) if samples is None else samples
            if not isinstance(names, list) or len(names) != len(batch) or \
                    not all(isinstance(n, int) and not isinstance(n, bool) for n in names):
                raise TypeError(f"ServedTeacher.submit(samples=...) must be a list of {len(batch)} ints (the index "
                                "each sample is named by), or None")
            given = self.route.given_ids(batch, ids, self.url)  # a head's only
            model = self.served_model(step.deadline)
            self.check_lengths(batch, model, names)
        except Exception as error:  # noqa: BLE001 - handed to result(), agreed there
            return PendingScores(self.url, batch, {}, step, self.route, failure=error)
        pending = {i: self.endpoint.ask(model, SampleAsk([int(v) for v in sequence.tolist()],
                                                         batch.response_starts[i], names[i]), step)
                   for i, sequence in enumerate(batch.sequences) if batch.response_rows(i)}
        return PendingScores(self.url, batch, pending, step, self.route, given, names)

    def project(self, batch: TeacherBatch, got: Any, ids: list[torch.Tensor] | None = None) -> BatchScores:
        """What every rank makes of what was asked for `batch` (`AsyncTeacher`): with a head the
        hidden states [R_i, H] through it (with `ids`, scored at them too), the head's ops alike on
        every rank of its group; without one the scores as they came (`routes`)."""
        return self.route.project(batch, got, ids)

    def check_lengths(self, batch: TeacherBatch, model: ServedModel, names: list[int] | None = None) -> None:
        """Every sample fits the served model: at most `model.longest` ids (max model length - 1
        where the engine generates a token after the prompt; a pooling server's whole length).
        `names`: each sample's index in the messages (None: its place in `batch`)."""
        room = model.longest
        for i, ids in enumerate(batch.sequences):
            if len(ids) > room:
                i = i if names is None else names[i]
                raise ServedTeacherRefusal(
                    f"sample {i} has {len(ids)} ids, over {self.url}'s max model length {model.max_model_len}"
                    + (f" - {model.generates} (the engine generates one token after the prompt)"
                       if room < model.max_model_len else "")
                    + f": a sequence cannot be split (every row needs its whole prefix); serve the teacher with "
                    f"--max-model-len >= {len(ids) + model.generates}", self.url, i)

    def close(self) -> None:
        """Stop the worker threads and close the connection pools."""
        self.endpoint.close()

    def __enter__(self) -> ServedTeacher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PendingScores:
    """A step's samples in flight (one future per sample with rows); `result()` waits (until the
    step's deadline) and assembles; `cancel()` stops them."""

    def __init__(self, url: str, batch: TeacherBatch, pending: dict[int, futures.Future], step: Step, route: Route,
                 ids: list[torch.Tensor] | None = None, names: list[int] | None = None,
                 failure: Exception | None = None) -> None:
        self.url, self.batch, self.pending = url, batch, pending
        self.names = names  # each sample's index in the messages (None: its place in the batch)
        self.step, self.route, self.ids = step, route, ids  # `ids`: a head's to score at, checked
        self.failure = failure

    @property
    def deadline(self) -> Deadline:
        return self.step.deadline

    def cancel(self) -> None:
        """Stop the step's requests (their answers dropped, no retry)."""
        self.step.cancel.set()

    def result(self, group: object = None, *, projected: bool = True) -> Any:
        """The step's `BatchScores`; a failure (the first sample's, by index) raised on every rank
        of `group` when one is given (every rank of it calls `result` with it). With a head and
        `projected=False`: the hidden states [R_i, H] per sample as the server sent them (the
        teacher step projects them on every rank itself)."""
        try:
            scores = self._collect()
        except Exception as error:  # noqa: BLE001 - agreed over the group, then raised
            agree_failure(error, group)
            raise
        agree_failure(None, group)
        if projected:  # a head's ops (collectives over its group) on every rank alike, once the failure is agreed
            return self.route.project(self.batch, scores, self.ids)
        return scores

    def _collect(self) -> Any:
        if self.failure is not None:
            raise self.failure
        done, waiting = futures.wait(list(self.pending.values()), timeout=max(self.deadline.remaining(), 0.0),
                                     return_when=futures.FIRST_EXCEPTION)
        failed = sorted(i for i, f in self.pending.items() if f in done and f.exception() is not None)
        if failed or waiting:
            self.cancel()
        if failed:
            raise self.pending[failed[0]].exception()  # type: ignore[misc]
        if waiting:
            late = sorted(i for i, f in self.pending.items() if f in waiting)
            first = late[0] if self.names is None else self.names[late[0]]
            raise ServedTeacherError(f"{self.url} (sample {first}): no reply within the step's deadline of "
                                     f"{self.deadline.seconds:g} s ({len(late)} of {len(self.pending)} samples "
                                     f"unanswered)", self.url, first)
        # the rows as sent, or a head's hidden states [R_i, H] (projected once agreed)
        return self.route.answered(self.batch, {i: future.result() for i, future in self.pending.items()})
