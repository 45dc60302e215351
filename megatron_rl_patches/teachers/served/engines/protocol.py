"""What every served engine answers to (`ServedEngine`) and the reply types it answers with:
the served model (`ServedModel`) and one sample's scores on its response rows (`SampleRows`), or
their hidden states (a tensor [R, H]): an engine declares which (`kind`: `ROWS` or `STATES`) and
answers only that."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.teachers.served.http import Deadline, TeacherClient

ROWS = "rows"  # an engine's `ask` answers `SampleRows`: the teacher's own top-k, tail and token log-probs
STATES = "states"  # an engine's `ask` answers the final hidden states [R, H], projected by the head on the trainer


@dataclass(frozen=True)
class ServedModel:
    """What the server serves: the model's name and its max model length (prompt + generated);
    `root`: where the server loaded it from (vLLM's card `root`; None where not sent), which tells
    two checkpoints served under one name apart, not two copies of one; `generates`: the tokens a
    request generates after the prompt (a sample holds at most `max_model_len - generates` ids);
    `answer`: what the server computed for the engine's fixed probe (its rows, or hidden states),
    which tells replicas of one teacher from servers of another (`served.identity`); `shares_prefix`:
    the server is `megatron-rl-patches serve-teacher` (its card says so), which computes the ids
    before a sample's response once for the samples that share them when told where the response
    starts (the request field `response_start`)."""

    name: str
    max_model_len: int
    root: str | None = None
    generates: int = 1
    answer: Any = field(default=None, compare=False, repr=False)
    shares_prefix: bool = field(default=False, compare=False)

    @property
    def longest(self) -> int:
        """The most ids a sample may hold."""
        return self.max_model_len - self.generates


@dataclass(frozen=True)
class SampleRows:
    """One sample's scores on its response rows (float64; ids int64)."""

    token_log_probs: torch.Tensor
    topk_ids: torch.Tensor
    topk_log_probs: torch.Tensor
    tail_log_probs: torch.Tensor


class ServedEngine(Protocol):
    """One engine's routes over a teacher's client (`model`: the served model's name to ask for,
    None: the one the server serves); `kind`: what `ask` answers (`ROWS` or `STATES`)."""

    client: TeacherClient
    top_k: int
    kind: str
    tokenize_path: str  # the route `tokenize` asks (messages name it)

    def served_model(self, deadline: Deadline, cancel: threading.Event) -> ServedModel:
        """The model at the URL, asked once (and whatever else the engine checks then)."""
        ...

    def ask(self, model: ServedModel, ids: list[int], start: int, deadline: Deadline,
            cancel: threading.Event, sample: int | None) -> SampleRows | torch.Tensor:
        """Rows start..len(ids)-1 of one sample (its ids), as the engine's `kind` says."""
        ...

    def tokenize(self, model: ServedModel, text: str, deadline: Deadline, cancel: threading.Event) -> list[int] | None:
        """`text` tokenized by the served model's tokenizer, no special tokens added (None: the
        server's reply holds no token list)."""
        ...
