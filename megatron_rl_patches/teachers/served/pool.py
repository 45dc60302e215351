"""A served teacher's replicas as one endpoint (`ReplicaPool`): one URL's endpoints (`server.Server`,
one per URL; one URL is a pool of one), checked at connect as one teacher and asked through the
scheduler (`scheduler.Scheduler`: spreading, failover, hedging). The engines stay a request body
and a parsed reply; everything about several servers lives here. How the pool behaves is
`settings.ReplicaSettings`.

At connect every replica is asked (in order) and must serve the same model: the same
`ServedModel` (the `/v1/models` card's name, root and max model length), the engine's probe on
each (K within its limit; with a head, states of the head's width), the same tokenization of the
tokenizer probe; a replica that differs, or does not answer, is refused by its URL."""
from __future__ import annotations

import concurrent.futures as futures
import threading
from collections.abc import Sequence

from megatron_rl_patches.teachers.errors import ServedTeacherRefusal
from megatron_rl_patches.teachers.redaction import redacted
from megatron_rl_patches.teachers.served.endpoint import Endpoint, SampleAsk, Step
from megatron_rl_patches.teachers.served.engines.protocol import ServedModel
from megatron_rl_patches.teachers.served.http import Deadline
from megatron_rl_patches.teachers.served.scheduler import Scheduler
from megatron_rl_patches.teachers.served.settings import ReplicaSettings
from megatron_rl_patches.teachers.served.urls import SEPARATOR


class ReplicaPool:
    """The `replicas` (endpoints of one kind) of one teacher, scheduled by `settings`; its `url`
    their URLs joined by '|'."""

    def __init__(self, replicas: Sequence[Endpoint], settings: ReplicaSettings) -> None:
        self.replicas = list(replicas)
        self.url = SEPARATOR.join(replica.url for replica in self.replicas)
        self.kind = self.replicas[0].kind
        self.scheduler = Scheduler(self.replicas, settings, self.url)

    def __len__(self) -> int:
        return len(self.replicas)

    def served_model(self, deadline: Deadline, cancel: threading.Event) -> ServedModel:
        """Every replica's served model (its engine's checks on each), the same on all, or refused
        naming the replica that differs."""
        first = self.replicas[0]
        model = first.served_model(deadline, cancel)
        for replica in self.replicas[1:]:
            other = replica.served_model(deadline, cancel)
            if other != model:
                raise ServedTeacherRefusal(
                    f"replica {redacted(replica.url)} serves {described(other)}, but replica {redacted(first.url)} "
                    f"serves {described(model)}: the replicas of one teacher serve the same model (the same "
                    f"checkpoint and max model length); serve it the same, or take it out of the teacher's URLs",
                    self.url)
        return model

    def tokenize(self, model: ServedModel, text: str, deadline: Deadline, cancel: threading.Event) -> list[int] | None:
        """`text` tokenized by every replica: the same ids from each, or refused naming the one
        that differs."""
        first = self.replicas[0]
        ids = first.tokenize(model, text, deadline, cancel)
        for replica in self.replicas[1:]:
            other = replica.tokenize(model, text, deadline, cancel)
            if other != ids:
                raise ServedTeacherRefusal(
                    f"replica {redacted(replica.url)} tokenizes a probe text into other ids than replica "
                    f"{redacted(first.url)} ({'no tokens' if other is None else f'{len(other)} ids'} against "
                    f"{'no tokens' if ids is None else f'{len(ids)}'}): the replicas of one teacher serve the same "
                    f"tokenizer; serve it the same, or take it out of the teacher's URLs", self.url)
        return ids

    def ask(self, model: ServedModel, sample: SampleAsk, step: Step) -> futures.Future:
        return self.scheduler.ask(model, sample, step)

    def close(self) -> None:
        self.scheduler.close()
        for replica in self.replicas:
            replica.close()


def described(model: ServedModel) -> str:
    root = "" if model.root is None else f", root {model.root!r}"
    return f"model {model.name!r}{root}, max model length {model.max_model_len}"
