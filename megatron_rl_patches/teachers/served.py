"""A teacher served by an inference engine (`ServedTeacher`): its own top-k with the exact tail
for every response row of a `TeacherBatch`, asked over HTTP. One connection pool per server; a
step's samples in flight at once (bounded in requests and tokens), within one deadline; a
teacher's replicas (several URLs) spread, failed over and hedged by `replicas.ReplicaPool`."""
from __future__ import annotations

import concurrent.futures as futures
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches._args import positive_int
from megatron_rl_patches.teachers.agreement import agree_failure, agree_teacher
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.client_settings import ClientSettings
from megatron_rl_patches.teachers.context_key import context_key
from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.engines.names import check_engine, engine_class
from megatron_rl_patches.teachers.engines.protocol import SampleRows, ServedModel
from megatron_rl_patches.teachers.engines.vllm_pooling import VllmPoolingEngine
from megatron_rl_patches.teachers.errors import ServedTeacherError, ServedTeacherRefusal
from megatron_rl_patches.teachers.finite import utf8_text
from megatron_rl_patches.teachers.head import TeacherHead
from megatron_rl_patches.teachers.hidden_scores import (
    check_given_ids,
    head_scores,
    head_temperature,
    hidden_head,
    states_dtype,
)
from megatron_rl_patches.teachers.http_client import Deadline, TeacherClient
from megatron_rl_patches.teachers.replica_settings import ReplicaSettings
from megatron_rl_patches.teachers.replica_step import Replica, StepReplicas
from megatron_rl_patches.teachers.replica_urls import SEPARATOR, replica_urls
from megatron_rl_patches.teachers.replicas import ReplicaPool
from megatron_rl_patches.teachers.token_budget import TokenBudget


class ServedTeacher:
    """A teacher at `url` (http(s)://host:port) served by `engine`, scoring its own `top_k`
    buckets per row (K within the server's limit: vLLM's `--max-logprobs`, default 20). Engines
    score at temperature 1 whatever is asked: another `temperature` is refused. `client` sets the
    timeouts, deadline, retries, bounds, API key variable and CA bundle (`ClientSettings`; the
    bounds in flight are each server's). `url` may name the teacher's replicas: a list of URLs
    (or one str of them joined by '|'), one teacher served the same by each; `replicas` says how
    a step spreads, fails over and hedges over them (`ReplicaSettings`).
    `context`: the key of each sample's privileged context in the teacher step
    (`TeacherStep.send(batch, contexts={KEY: ...})`): it scores them before the student's response."""

    def __init__(self, url: str | list[str], engine: str = "vllm", top_k: int = 20, *, model: str | None = None,
                 temperature: float = 1.0, client: ClientSettings | None = None,
                 head: TeacherHead | str | os.PathLike[str] | None = None,
                 hidden_dtype: torch.dtype | None = None, context: str | None = None,
                 replicas: ReplicaSettings | None = None) -> None:
        self.context = context_key(context, "ServedTeacher(context=...)")
        self.head = hidden_head(head, engine)
        self.engine_name = check_engine(engine)
        self.top_k = positive_int("ServedTeacher(top_k=...)", top_k, " (the teacher's buckets per row)")
        self.temperature = 1.0
        if self.head is not None:  # the trainer forms the distribution: any K of the vocabulary, any temperature
            self.temperature = head_temperature(temperature, top_k, self.head)
        elif isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature != 1.0:
            raise ValueError(f"ServedTeacher(temperature={temperature!r}): served engines score prompt log-probs at "
                             f"temperature 1 whatever is asked, so only temperature=1.0 can be served (score at the "
                             f"student's temperature 1, or use an in-process teacher)")
        if model is not None and not isinstance(model, str):
            raise TypeError(f"ServedTeacher(model=...) must be the served model's name (a str) or None, got "
                            f"{type(model).__name__}")
        if client is not None and not isinstance(client, ClientSettings):
            raise TypeError(f"ServedTeacher(client=...) must be a ClientSettings, got {type(client).__name__}")
        if replicas is not None and not isinstance(replicas, ReplicaSettings):
            raise TypeError(f"ServedTeacher(replicas=...) must be a ReplicaSettings, got {type(replicas).__name__}")
        self.settings = client or ClientSettings()
        clients = [TeacherClient(one, self.settings) for one in replica_urls(url)]
        self.client = clients[0]
        self.url = SEPARATOR.join(c.url for c in clients)
        dtype = states_dtype(hidden_dtype, self.head)  # None without a head (a hidden_dtype then refused)
        self.replicas = ReplicaPool([Replica(c.url, c, self.engine_for(c, model, dtype)) for c in clients],
                                    replicas or ReplicaSettings(), self.url)
        self.engine = self.replicas.replicas[0].engine
        self._model: ServedModel | None = None
        # the bounds in flight are each server's: n replicas hold n times as much
        self._budget = TokenBudget(self.settings.max_tokens_in_flight * len(self.replicas))
        self._pool: futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def engine_for(self, client: TeacherClient, model: str | None, dtype: torch.dtype | None) -> Any:
        """The engine asking one server through `client`."""
        if self.head is None:
            return engine_class(self.engine_name)(client, self.top_k, model)
        assert dtype is not None  # one engine serves hidden states: vLLM's pooling runner
        return VllmPoolingEngine(client, self.top_k, model, self.head.hidden_size, dtype, self.head.source,
                                 self.head.fingerprint)

    def __repr__(self) -> str:
        return f"ServedTeacher({self.url!r}, engine={self.engine_name!r}, top_k={self.top_k})"

    # ------------------------------------------------------------------ the server
    def served_model(self, deadline: Deadline | None = None) -> ServedModel:
        """The served model (name, max model length), asked once; K checked against the server
        (each replica: the same model on all, or refused naming the one that differs)."""
        with self._lock:
            if self._model is None:
                self._model = self.replicas.served_model(deadline or Deadline.after(self.settings.deadline_s),
                                                         threading.Event())
            return self._model

    def check(self) -> ServedModel:
        """Ask the server now (it answers, the model, its max length, K within its limit)."""
        return self.served_model()

    def tokenize(self, text: str, deadline: Deadline | None = None) -> list[int] | None:
        """`text` tokenized by the served model's tokenizer, no special tokens added (None: the
        server answered with no token list), within `deadline` (default: one request's timeout);
        every replica asked (the same ids from each, or refused naming the one that differs)."""
        utf8_text(text, "ServedTeacher.tokenize(text=...)")  # a bare UnicodeEncodeError from the JSON body otherwise
        deadline = deadline or Deadline.after(self.settings.timeout_s)
        return self.replicas.tokenize(self.served_model(deadline), text, deadline, threading.Event())

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

    def submit(self, batch: TeacherBatch, *, ids: list[torch.Tensor] | None = None) -> PendingScores:
        """Send every sample now (background threads) and return at once: `.result()` collects.
        Nothing raises here: a refusal or failure (the server asked first, a sample too long)
        comes out of `.result()`, where it is agreed over a group like any other."""
        deadline = Deadline.after(self.settings.deadline_s)
        cancel = threading.Event()
        try:
            if not isinstance(batch, TeacherBatch):
                raise TypeError(f"ServedTeacher.score(batch) takes a TeacherBatch, got {type(batch).__name__}")
            given = self.check_ids(batch, ids)
            model = self.served_model(deadline)
            self.check_lengths(batch, model)
        except Exception as error:  # noqa: BLE001 - handed to result(), agreed there
            return PendingScores(self.url, batch, {}, deadline, cancel, self.top_k, failure=error)
        pending = {}
        step = self.replicas.step()
        for i, sequence in enumerate(batch.sequences):
            if batch.response_rows(i):
                pending[i] = self.pool().submit(self._score_one, model, [int(v) for v in sequence.tolist()],
                                                batch.response_starts[i], deadline, cancel, i, step)
        project = None
        if self.head is not None:
            head, k, tau = self.head, self.top_k, self.temperature
            project = lambda states: head_scores(head, batch, states, k, tau, given)  # noqa: E731
        no_rows = torch.zeros(0, self.engine.hidden_size, dtype=self.engine.dtype) \
            if isinstance(self.engine, VllmPoolingEngine) else None
        return PendingScores(self.url, batch, pending, deadline, cancel, self.top_k, project=project, no_rows=no_rows)

    def check_ids(self, batch: TeacherBatch, ids: object) -> list[torch.Tensor] | None:
        """`ids` of `score` (a head only); with a head every sample's ids within its vocabulary."""
        if self.head is None:
            if ids is not None:
                raise ServedTeacherRefusal("ServedTeacher.score(ids=...) needs a head (ServedTeacher(head=...)): an "
                                           "engine's prompt log-probs hold only the teacher's own top-k", self.url)
            return None
        for i, sequence in enumerate(batch.sequences):
            if len(sequence) and int(sequence.max()) >= self.head.vocab_size:
                raise ServedTeacherRefusal(f"sample {i} holds id {int(sequence.max())}, outside the teacher head's "
                                           f"vocabulary of {self.head.vocab_size}", self.url, i)
        return check_given_ids(ids, batch, self.head.vocab_size)

    def check_lengths(self, batch: TeacherBatch, model: ServedModel) -> None:
        """Every sample fits the served model: at most max model length - 1 ids (a pooling
        server generates nothing: max model length)."""
        room = model.max_model_len - getattr(self.engine, "generates", 1)
        for i, ids in enumerate(batch.sequences):
            if len(ids) > room:
                raise ServedTeacherRefusal(
                    f"sample {i} has {len(ids)} ids, over {self.url}'s max model length {model.max_model_len}"
                    + (" - 1 (the engine generates one token after the prompt)" if room < model.max_model_len else "")
                    + f": a sequence cannot be split (every row needs its whole prefix); serve the teacher with "
                    f"--max-model-len >= {len(ids) + model.max_model_len - room}", self.url, i)

    def _score_one(self, model: ServedModel, ids: list[int], start: int, deadline: Deadline,
                   cancel: threading.Event, sample: int, step: StepReplicas) -> SampleRows | torch.Tensor:
        if cancel.is_set():
            raise ServedTeacherError(f"{self.url}: sample {sample} not sent: the step failed before", self.url, sample)
        if not self._budget.acquire(len(ids), deadline.at, cancel):
            raise ServedTeacherError(f"{self.url}: sample {sample} waited for tokens in flight past the step's "
                                     f"deadline of {deadline.seconds:g} s", self.url, sample)

        def ask(engine: Any, cancelled: threading.Event) -> SampleRows | torch.Tensor:
            if isinstance(engine, VllmPoolingEngine):
                return engine.hidden_states(model, ids, start, deadline, cancelled, sample)
            return engine.scores(model, ids, start, deadline, cancelled, sample)

        try:
            if len(self.replicas) == 1:  # one server: asked as it always was
                return ask(self.engine, cancel)
            return step.run(ask, sample, tuple(ids[:start]), deadline, cancel)
        finally:
            self._budget.release(len(ids))

    def pool(self) -> futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = futures.ThreadPoolExecutor(self.settings.max_in_flight * len(self.replicas),
                                                        thread_name_prefix="served-teacher")
            return self._pool

    def close(self) -> None:
        """Stop the worker threads and close the connection pool."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
        for replica in self.replicas.replicas:
            replica.client.close()

    def __enter__(self) -> ServedTeacher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PendingScores:
    """A step's samples in flight; `result()` waits (until the step's deadline) and assembles."""

    def __init__(self, url: str, batch: TeacherBatch, pending: dict[int, futures.Future], deadline: Deadline,
                 cancel: threading.Event, top_k: int, failure: Exception | None = None,
                 project: Callable[[list[torch.Tensor]], BatchScores] | None = None,
                 no_rows: torch.Tensor | None = None) -> None:
        self.url, self.batch, self.pending = url, batch, pending
        self.deadline, self.cancel, self.top_k = deadline, cancel, top_k
        self.failure = failure
        self.project = project  # hidden states -> scores through the head, after the failure is agreed
        self.no_rows = torch.zeros(0, 0) if no_rows is None else no_rows  # a sample of no rows' states [0, H]

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
        if self.project is not None and projected:  # the head's ops (collectives over its group) on every rank alike
            return self.project(scores)
        return scores

    def _collect(self) -> Any:
        if self.failure is not None:
            raise self.failure
        done, waiting = futures.wait(list(self.pending.values()), timeout=max(self.deadline.remaining(), 0.0),
                                     return_when=futures.FIRST_EXCEPTION)
        failed = sorted(i for i, f in self.pending.items() if f in done and f.exception() is not None)
        if failed or waiting:
            self.cancel.set()
            for future in waiting:
                future.cancel()
        if failed:
            raise self.pending[failed[0]].exception()  # type: ignore[misc]
        if waiting:
            late = sorted(i for i, f in self.pending.items() if f in waiting)
            raise ServedTeacherError(f"{self.url} (sample {late[0]}): no reply within the step's deadline of "
                                     f"{self.deadline.seconds:g} s ({len(late)} of {len(self.pending)} samples "
                                     f"unanswered)", self.url, late[0])
        if self.project is not None:  # hidden states [R_i, H], projected once agreed
            return [self.pending[i].result() if i in self.pending else self.no_rows
                    for i in range(len(self.batch))]
        rows = [self.pending[i].result() if i in self.pending else empty_rows(self.top_k)
                for i in range(len(self.batch))]
        return BatchScores([r.token_log_probs for r in rows], [r.topk_ids for r in rows],
                           [r.topk_log_probs for r in rows], [r.tail_log_probs for r in rows])


def empty_rows(k: int) -> SampleRows:
    """A sample with no response rows."""
    values = torch.zeros(0, k, dtype=torch.float64)
    return SampleRows(torch.zeros(0, dtype=torch.float64), torch.zeros(0, k, dtype=torch.int64), values,
                      torch.zeros(0, dtype=torch.float64))
