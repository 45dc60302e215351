"""The live self-teacher's rows of one rollout, scored in verl's old-log-prob pass (`self_teacher`'s
note): each privileged sequence's top-k ids and log-probs under the weights the step's old
log-probs come from, read back by the update's distillation micro-batches.

Keyed by what the rows depend on: the privileged sequence (context + response ids), where its
response starts, and K. One pass's rows at a time: the first micro-batch of a new log-prob pass
forgets the last pass's (`OldRows.note_step`), so the cache holds one rollout's rows (on the CPU) at most.
Held by verl's engine that runs both passes (`old_rows_of`), not by the module."""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from megatron_rl_patches.integrations.verl.held import held


def sample_key(sequence: torch.Tensor, start: int, k: int) -> bytes:
    """The cache key of one privileged sequence scored from `start` with K = `k`."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{int(start)}:{int(k)}:".encode())
    digest.update(sequence.detach().cpu().long().contiguous().numpy().tobytes())
    return digest.digest()


class OldRows:
    """The rows of the last old-log-prob pass, by `sample_key`."""

    def __init__(self) -> None:
        self.rows: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pass_id: int | None = None

    def note_step(self, pass_id: int | None) -> None:
        """The engine's step is a micro-batch of the log-prob pass `pass_id` (verl's micro-batch
        iterator's id; None: any other step). The first micro-batch of a new pass, or of a pass
        after any other step, forgets the last pass's rows."""
        if pass_id is not None and pass_id != self.pass_id:
            self.rows.clear()
        self.pass_id = pass_id

    def put(self, key: bytes, ids: torch.Tensor, log_probs: torch.Tensor) -> None:
        self.rows[key] = (ids.detach().cpu(), log_probs.detach().cpu())

    def get(self, keys: list[bytes]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every key's rows, or None where one is missing."""
        found = [self.rows.get(key) for key in keys]
        return None if any(rows is None for rows in found) else [rows for rows in found if rows is not None]

    def forget(self) -> None:
        self.rows.clear()
        self.pass_id = None


def old_rows_of(engine: Any) -> OldRows:
    """The rows kept by verl's engine (its `MegatronEngineWithLMHead`: the actor's log-prob pass and
    its update run on the same one)."""
    return held(engine, "old_rows", OldRows)
