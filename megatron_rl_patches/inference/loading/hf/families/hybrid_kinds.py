"""The fuse kinds of Qwen3.5's layers (families/qwen3_5.py; Qwen3-Next's fused projection is in
qwen3_next.py): the gated attention's q_proj ([query, gate] per head) fused with k and v per query
group (`GATED_QKV`), and the gated delta net's q/k/v, z, b, a projections (`GDN_IN`) and
convolution (`GDN_CONV`) arranged per tensor-parallel rank. The layouts are hybrid_layout.py's,
run on row labels so that a rank reads only the rows it holds (views.fused_rows). No torch until a
slice is filled (the memory planner reads the kinds without it)."""
# lazy imports: import cost: memory --hf plans without torch (a fill's hybrid_layout / views import it)
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_rl_patches.inference.loading.hf.families.common_kinds import repeated_qkv_params
from megatron_rl_patches.inference.loading.hf.families.fuse_kind import FuseKind, Pieces, register
from megatron_rl_patches.inference.loading.hf.families.kv_heads import kv_repeat

if TYPE_CHECKING:
    import torch

    from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture


class GatedQkv(FuseKind):
    """linear_qkv with the attention output gate: per query group its queries, gates, key and value."""

    name, arity = "gated_qkv", 3

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        from megatron_rl_patches.inference.loading.hf.families.hybrid_layout import gated_qkv
        from megatron_rl_patches.inference.loading.hf.families.views import fused_rows, whole

        repeat = kv_repeat(arch, size)  # the key/value heads repeated where size exceeds them: one per rank
        return whole(fused_rows(lambda *x: gated_qkv(arch, *x, repeat=repeat).chunk(size, dim=0)[rank], tensors))

    def rank_params(self, arch: HFArchitecture, sizes: Sequence[int], tp: int) -> int | None:
        return repeated_qkv_params(arch, sizes, tp)


class GdnIn(FuseKind):
    """The gated delta net's in_proj from in_proj_qkv, in_proj_z, in_proj_b and in_proj_a."""

    name, arity = "gdn_in", 4

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        from megatron_rl_patches.inference.loading.hf.families.hybrid_layout import linear_in_proj
        from megatron_rl_patches.inference.loading.hf.families.views import fused_rows, whole

        return whole(fused_rows(lambda *x: linear_in_proj(arch, *x, rank=rank, size=size), tensors))


class GdnConv(FuseKind):
    """The gated delta net's conv1d: the rank's q, k and v channels."""

    name = "gdn_conv"

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        from megatron_rl_patches.inference.loading.hf.families.hybrid_layout import linear_conv
        from megatron_rl_patches.inference.loading.hf.families.views import fused_rows, whole

        return whole(fused_rows(lambda x: linear_conv(arch, x, rank, size), tensors))


GATED_QKV = register(GatedQkv())
GDN_IN = register(GdnIn())
GDN_CONV = register(GdnConv())
