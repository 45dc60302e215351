"""Which checkpoint a teacher head was read from (`checkpoint_fingerprint`, `HeadFacts`) and the
heads of a group's ranks compared (`compare_heads`): two checkpoints of one architecture have the
same shapes, so the tensor headers cannot tell them apart; the fingerprint hashes config.json
(canonical JSON, the fields that name a copy left out) and a few fixed rows of the output layer's
data (the first, middle and last vocabulary rows: a few kB, read by every rank alike whatever its
shard). A rank holding another checkpoint's head, another width or another padding is the same
ValueError on every rank, naming each rank's directory, before anything projects through it."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.inference.loading.hf.files import TensorEntry, safe_open_of
from megatron_rl_patches.ops.agreement import gathered_objects

# config.json fields that differ between copies of one checkpoint (where it was saved from, by what)
COPY_FIELDS = ("_name_or_path", "transformers_version")


def checkpoint_fingerprint(fields: dict[str, Any], entry: TensorEntry) -> str:
    """A hash of config.json's `fields` and rows 0, V // 2 and V − 1 of the output layer `entry`."""
    kept = {key: value for key, value in fields.items() if key not in COPY_FIELDS}
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str).encode("utf-8"))
    view = safe_open_of(entry.file).get_slice(entry.name)
    rows = entry.shape[0]
    for row in sorted({0, rows // 2, rows - 1}):
        digest.update(row_bytes(view[row:row + 1]))
    return digest.hexdigest()[:16]


def weight_fingerprint(weight: torch.Tensor) -> str:
    """A hash of rows 0, V // 2 and V − 1 of a whole head's weight (a head built by hand)."""
    digest = hashlib.sha256(str((tuple(weight.shape), str(weight.dtype))).encode("utf-8"))
    rows = weight.shape[0]
    for row in sorted({0, rows // 2, rows - 1}) if rows else ():
        digest.update(row_bytes(weight[row:row + 1].detach().cpu()))
    return "weight:" + digest.hexdigest()[:16]


def row_bytes(rows: torch.Tensor) -> bytes:
    return rows.contiguous().view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True)
class HeadFacts:
    """What must be equal on every rank: the checkpoint's fingerprint and the head's sizes and
    dtype (`source`, the directory, only named)."""

    source: str
    fingerprint: str
    hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    dtype: str

    def compared(self) -> tuple[Any, ...]:
        return self.fingerprint, self.hidden_size, self.vocab_size, self.padded_vocab_size, self.dtype

    def __str__(self) -> str:
        return (f"{self.source or 'a head built by hand'} (fingerprint {self.fingerprint}, hidden {self.hidden_size}, "
                f"vocabulary {self.vocab_size} padded to {self.padded_vocab_size}, {self.dtype})")


def head_facts(head: Any) -> HeadFacts:
    """A `TeacherHead`'s facts: its checkpoint's fingerprint (a whole head built by hand: its
    weight's; a shard built by hand: none, its sizes compared only)."""
    fingerprint = getattr(head, "fingerprint", "")
    if not fingerprint:
        fingerprint = weight_fingerprint(head.weight) if head.tp_group is None else "unknown"
    return HeadFacts(head.source, fingerprint, head.hidden_size, head.vocab_size, head.padded_vocab_size,
                     str(head.dtype))


def compare_heads(group: Any, what: str, mine: list[HeadFacts | None], error: BaseException | None = None,
                  where: str = "the group") -> None:
    """Every rank of `group` passes its heads' facts (one per teacher, None where a teacher has no
    head) and its local `error`: one object all-gather, then on every rank alike the lowest failing
    rank's error, or a ValueError naming each rank's head where they differ. Without a group: the
    local `error` raised."""
    said_here = None if error is None else f"{type(error).__name__}: {error}"
    every: list[tuple[str | None, list[Any]]] = gathered_objects(  # type: ignore[assignment]
        group, (said_here, [None if facts is None else (facts, facts.compared()) for facts in mine]))
    failed = [(rank, said) for rank, (said, _) in enumerate(every) if said is not None]
    if failed:
        if error is not None and len(every) == 1:
            raise error
        rank, said = group_ranks(group, len(every))[failed[0][0]], failed[0][1]
        raise ValueError(f"{what}: refused on rank {rank} of {where} (so on every rank): {said}") from error
    ranks = group_ranks(group, len(every))
    counts = {len(heads) for _, heads in every}
    if len(counts) > 1:
        named = ", ".join(f"rank {rank}: {len(heads)}" for rank, (_, heads) in zip(ranks, every))
        raise ValueError(f"{what}: the ranks of {where} hold different numbers of teachers ({named})")
    for teacher in range(len(mine)):
        seen = [heads[teacher] for _, heads in every]
        if len({None if facts is None else facts[1] for facts in seen}) > 1:
            named = "; ".join(f"rank {rank}: {'no head' if facts is None else facts[0]}"
                              for rank, facts in zip(ranks, seen))
            raise ValueError(f"{what}: the ranks of {where} hold different teacher heads{teacher_name(teacher, mine)} "
                             f"({named}): every rank must read the same checkpoint's output layer (the one its "
                             "server serves)")


def group_ranks(group: Any, size: int) -> list[int]:
    """The global ranks of `group`'s members, in its order (0 .. size − 1 without one)."""
    if size == 1 or group is None:
        return list(range(size))
    import torch.distributed as dist  # lazy: import cost: only with a group

    return list(dist.get_process_group_ranks(group))


def teacher_name(teacher: int, mine: list[Any]) -> str:
    return f" for teacher {teacher}" if len(mine) > 1 else ""
