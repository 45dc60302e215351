"""What every served engine answers to (`ServedEngine`) and the reply types it answers with:
the served model (`ServedModel`) and one sample's scores on its response rows (`SampleRows`)."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.teachers.served.http import Deadline, TeacherClient


@dataclass(frozen=True)
class ServedModel:
    """What the server serves: the model's name and its max model length (prompt + generated);
    `root`: where the server loaded it from (vLLM's card `root`; None where not sent), which tells
    two checkpoints served under one name apart."""

    name: str
    max_model_len: int
    root: str | None = None


@dataclass(frozen=True)
class SampleRows:
    """One sample's scores on its response rows (float64; ids int64)."""

    token_log_probs: torch.Tensor
    topk_ids: torch.Tensor
    topk_log_probs: torch.Tensor
    tail_log_probs: torch.Tensor


class ServedEngine(Protocol):
    """One engine's routes over a teacher's client, built as `Engine(client, top_k, model)`
    (`model`: the served model's name to ask for, None: the one the server serves)."""

    client: TeacherClient
    top_k: int
    tokenize_path: str  # the route `tokenize` asks (messages name it)

    def __init__(self, client: TeacherClient, top_k: int, model: str | None) -> None: ...

    def served_model(self, deadline: Deadline, cancel: threading.Event) -> ServedModel:
        """The model at the URL, asked once (and whatever else the engine checks then)."""
        ...

    def scores(self, model: ServedModel, ids: list[int], start: int, deadline: Deadline,
               cancel: threading.Event, sample: int | None) -> SampleRows:
        """Rows start..len(ids)-1 of one sample (its ids), scored by the server."""
        ...

    def tokenize(self, model: ServedModel, text: str, deadline: Deadline, cancel: threading.Event) -> list[int] | None:
        """`text` tokenized by the served model's tokenizer, no special tokens added (None: the
        server's reply holds no token list)."""
        ...
