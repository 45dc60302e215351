"""The fuse kinds every family uses (families/fuse_kind.py says what a kind is): a tensor held
whole (`REPLICATE`; `CENTRED`, a zero-centred norm's weight + 1), split by columns (`ROW`, a row-
parallel linear's input dimension) or by rows (`COLUMN`), gate and up stacked per rank (`GATED`,
SwiGLU's linear_fc1), q/k/v fused per query group (`QKV`) and the padded vocabulary (`VOCAB`).

Each fill imports its torch layout when first run: importing the kinds (the memory planner, the
contract) imports no torch."""
# lazy imports: import cost: memory --hf plans without torch (a fill's views / common_layout import it)
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_rl_patches.inference.loading.hf.families.fuse_kind import FuseKind, Pieces, register
from megatron_rl_patches.inference.loading.hf.families.kv_heads import kv_repeat

if TYPE_CHECKING:
    import torch

    from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture


class Replicate(FuseKind):
    """Every rank holds the tensor whole (norms, a router)."""

    name, split = "replicate", False

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        from megatron_rl_patches.inference.loading.hf.families.views import whole

        return whole(tensors[0])


class Centred(FuseKind):
    """A zero-centred RMSNorm's weight ((1 + w) x^), held whole as megatron's w x^: w + 1 (exact)."""

    name, split = "centred", False

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        from megatron_rl_patches.inference.loading.hf.families.views import whole

        return whole(tensors[0] + 1)


class Row(FuseKind):
    """A row-parallel linear's weight: the rank's share of the input columns."""

    name = "row"

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        from megatron_rl_patches.inference.loading.hf.families.views import whole

        return whole(tensors[0].chunk(size, dim=1)[rank])


class Column(FuseKind):
    """A column-parallel linear's weight (or a per-head vector): the rank's share of the rows."""

    name = "column"

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        from megatron_rl_patches.inference.loading.hf.families.views import whole

        return whole(tensors[0].chunk(size, dim=0)[rank])


class Gated(FuseKind):
    """SwiGLU's gate and up projections, the rank's share of each stacked (linear_fc1)."""

    name, arity = "gated", 2

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        from megatron_rl_patches.inference.loading.hf.families.views import stacked

        return stacked([part.chunk(size, dim=0)[rank] for part in tensors])


def repeated_qkv_params(arch: HFArchitecture, sizes: Sequence[int], tp: int) -> int | None:
    """A rank's q/k/v parameters where its key/value head is repeated at `tp` (kv_heads.py): its
    share of the queries, one whole key and value head; None where none is repeated."""
    if kv_repeat(arch, tp) == 1:
        return None
    q, k, v = sizes
    return q // tp + (k + v) // arch.num_kv_heads


class Qkv(FuseKind):
    """q, k and v fused per query group (linear_qkv), the rank's query groups; where `size` exceeds
    the key/value heads, each repeated (kv_heads.py): the rank's one group and its key/value head."""

    name, arity = "qkv", 3

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        from megatron_rl_patches.inference.loading.hf.families.common_layout import qkv_pieces

        q, k, v = tensors
        return qkv_pieces(arch, q, k, v, rank=rank, size=size)

    def rank_params(self, arch: HFArchitecture, sizes: Sequence[int], tp: int) -> int | None:
        return repeated_qkv_params(arch, sizes, tp)


class Vocab(FuseKind):
    """An embedding or output table: the rank's rows of Megatron's padded vocabulary."""

    name = "vocab"

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        from megatron_rl_patches.inference.loading.hf.families.common_layout import vocab_pieces

        return vocab_pieces(tensors[0], padded_vocab, rank, size)


REPLICATE = register(Replicate())
CENTRED = register(Centred())
ROW = register(Row())
COLUMN = register(Column())
GATED = register(Gated())
QKV = register(Qkv())
VOCAB = register(Vocab())
