"""What a served teacher asks (`Endpoint`): one URL's engine (`server.Server`) and a teacher's
replicas (`pool.ReplicaPool`) answer alike — the served model, a text tokenized, one sample asked
(its response rows' scores, or their hidden states: the endpoint's `kind`), closed. A sample's
answer is a future, completed by whoever ends the request: nothing waits in a thread for it.
A step's samples share one `Step` (its deadline and its cancel)."""
from __future__ import annotations

import concurrent.futures as futures
import threading
from dataclasses import dataclass
from typing import Protocol

from megatron_rl_patches.teachers.served.cancel import Cancel
from megatron_rl_patches.teachers.served.engines.protocol import ServedModel
from megatron_rl_patches.teachers.served.http import Deadline


@dataclass(frozen=True)
class SampleAsk:
    """One sample to score: its ids, its response start (rows start..len(ids)-1 are asked) and
    its index in the step (None: a probe), which messages name."""

    ids: list[int]
    start: int
    index: int | None

    @property
    def prompt(self) -> tuple[int, ...]:
        """The ids before the response: the samples of one prompt share it."""
        return tuple(self.ids[:self.start])


@dataclass(frozen=True, eq=False)
class Step:
    """One step's deadline and cancel, shared by its samples' requests (one object a step: the
    replicas' scheduler tells steps apart by it)."""

    deadline: Deadline
    cancel: Cancel

    @classmethod
    def within(cls, seconds: float) -> Step:
        return cls(Deadline.after(seconds), Cancel())

    def child(self) -> Step:
        """The same deadline, a cancel of its own that the step's sets (one request of a sample)."""
        return Step(self.deadline, Cancel(self.cancel))


class Endpoint(Protocol):
    """One teacher's server(s): `url` (several joined by '|'), `kind` (what `ask` answers:
    `engines.protocol.ROWS` or `STATES`), `tokenize_path` (the route `tokenize` asks: messages
    name it)."""

    url: str
    kind: str
    tokenize_path: str

    def served_model(self, deadline: Deadline, cancel: threading.Event) -> ServedModel:
        """The served model (name, max model length), checked as the endpoint checks it."""
        ...

    def tokenize(self, model: ServedModel, text: str, deadline: Deadline, cancel: threading.Event) -> list[int] | None:
        """`text` tokenized by the served model's tokenizer, no special tokens added (None: no
        token list came back)."""
        ...

    def ask(self, model: ServedModel, sample: SampleAsk, step: Step) -> futures.Future:
        """The sample's rows (`SampleRows`) or hidden states ([R, H]), as a future (its failure a
        `ServedTeacherError` naming the URL and the sample). Never raises itself."""
        ...

    def close(self) -> None:
        """Stop the endpoint's threads and close its connections."""
        ...
