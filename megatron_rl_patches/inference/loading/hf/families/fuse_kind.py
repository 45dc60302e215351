"""What a fuse kind is: how the Hugging Face tensors of one Megatron parameter make it on a
tensor-parallel rank. A `FuseKind` object owns all of it: how many tensors it fuses (`arity`,
checked by the family contract and before a fill), whether the parameter is divided over the
tensor-parallel ranks or held whole by each (`split`, what the memory plan counts; `rank_params`
where a rank holds more than its share: repeated key/value heads), and how a
rank's slice is filled from views of the tensors (`pieces`). The converter, the contract and the
memory plan ask the kind; none of them names one.

The common kinds are in `common_kinds.py`, a family's own beside it (`mla_kinds.py`,
`hybrid_kinds.py`, Qwen3-Next's in `qwen3_next.py`). A new kind is a subclass and one `register`
call in its module. No torch here: the memory planner and the contract read the kinds from
config.json alone (a kind imports its torch layout when it first fills a slice)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture

Shape = tuple[int, ...]
# where in the target a value goes, and the value (None: zeros); the target is never made apart
Piece = tuple[Callable[["torch.Tensor"], "torch.Tensor"], "torch.Tensor | None"]
Pieces = tuple[Shape, list[Piece]]


class FuseKind:
    """One way of making a Megatron parameter from Hugging Face tensors (see the module's docstring).
    A subclass sets `name`, `arity` and `split` and fills a slice in `pieces`."""

    name: str = ""
    arity: int = 1  # Hugging Face tensors per parameter
    split: bool = True  # divided over the tensor-parallel ranks (False: every rank holds it whole)

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        """Rank `rank` of `size`'s slice: its shape and the pieces that fill it from `tensors`."""
        raise NotImplementedError(f"fuse kind {self.name!r} ({type(self).__name__}) fills no slice: define pieces()")

    def rank_params(self, arch: HFArchitecture, sizes: Sequence[int], tp: int) -> int | None:
        """The parameters a rank holds at tensor-parallel size `tp`, from the sizes of the tensors
        fused, where its share is not `split`'s (rows repeated: key/value heads, kv_heads.py);
        None: `split` says it (1/tp of them, or all)."""
        return None

    def shard(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
              padded_vocab: int) -> Pieces:
        """`pieces`, after checking that `tensors` holds this kind's number of tensors."""
        if len(tensors) != self.arity:
            raise ValueError(f"fuse kind {self.name!r} fuses {self.arity} tensors, got {len(tensors)}")
        return self.pieces(arch, tensors, rank, size, padded_vocab)

    def __repr__(self) -> str:
        return f"<fuse kind {self.name!r}>"


_KINDS: dict[str, FuseKind] = {}


def register(kind: FuseKind) -> FuseKind:
    """`kind` under its name (the name a `Param` may give instead of the object); returns it."""
    if not kind.name or kind.arity < 1:
        raise ValueError(f"a fuse kind needs a name and an arity >= 1, got {type(kind).__name__} "
                         f"name={kind.name!r} arity={kind.arity!r}")
    known = _KINDS.get(kind.name)
    if known is not None and known is not kind:
        raise ValueError(f"fuse kind {kind.name!r} is already registered ({type(known).__name__})")
    _KINDS[kind.name] = kind
    return kind


def unregister(kind: FuseKind) -> None:
    """Forget `kind` (registered by :func:`register`: a test's or a plugin's own kind); ValueError
    where another kind holds its name."""
    if _KINDS.get(kind.name) is not kind:
        raise ValueError(f"fuse kind {kind.name!r} ({type(kind).__name__}) is not the registered one")
    del _KINDS[kind.name]


def registered() -> tuple[FuseKind, ...]:
    return tuple(_KINDS.values())


def fuse_kind(kind: FuseKind | str) -> FuseKind:
    """`kind` itself, or the registered kind of that name (ValueError naming the known ones)."""
    if isinstance(kind, FuseKind):
        return kind
    found = _KINDS.get(kind) if isinstance(kind, str) else None
    if found is None:
        raise ValueError(f"unknown fuse kind {kind!r}; registered: {', '.join(sorted(_KINDS))}")
    return found

