"""Multi-latent attention's fuse kinds (families/mla.py): its query projection (`MLA_Q`) and its
key/value down projection (`MLA_KV_DOWN`) split over the ranks by rows like a column-parallel
linear, the rows of their rotary part reordered for megatron-core first (it de-interleaves them:
transformers' `rope_interleave: true`). A rank reads only the span of rows it holds. No torch
until a slice is filled (the memory planner reads the kinds without it)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from megatron_rl_patches.inference.loading.hf.families.fuse_kind import FuseKind, Pieces, register

if TYPE_CHECKING:
    import torch

    from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture


def _rope_rows_for_megatron(rows: Any, rope: int, interleaved: bool) -> Any:
    """The last `rope` rows of each block of `rows` [blocks, width, ...] in the order megatron-core's
    MLA wants: it de-interleaves them (pairs (x0, x1), (x2, x3)... rotated together), as
    transformers does with rope_interleave=true; rotate-half rows are interleaved for it."""
    if interleaved:
        return rows
    # lazy: import cost: memory --hf plans without torch (only rotate-half checkpoints' rows need it)
    import torch

    head, tail = rows[:, :-rope], rows[:, -rope:]
    half = rope // 2
    woven = torch.stack([tail[:, :half], tail[:, half:]], dim=2).reshape(tail.shape)
    return torch.cat([head, woven], dim=1)


def query_rows(arch: HFArchitecture, weight: Any) -> Any:
    """q_proj / q_b_proj [heads x (nope + rope), in] with each head's rotary rows reordered."""
    m = arch.mla
    per_head = weight.reshape(arch.num_heads, m.q_head_dim, *weight.shape[1:])
    return _rope_rows_for_megatron(per_head, m.qk_rope_head_dim, m.rope_interleave).reshape(weight.shape)


def kv_down_rows(arch: HFArchitecture, weight: Any) -> Any:
    """kv_a_proj_with_mqa [kv_lora_rank + rope, in] with its rotary rows reordered."""
    m = arch.mla
    return _rope_rows_for_megatron(weight.unsqueeze(0), m.qk_rope_head_dim, m.rope_interleave).squeeze(0)


class RotaryRows(FuseKind):
    """A projection split by rows like a column-parallel linear, its rows reordered by `reorder`
    (arch, row numbers) -> row numbers first: the rank reads the span of rows its share lies in."""

    def __init__(self, name: str, reorder: Callable[[HFArchitecture, Any], Any]) -> None:
        self.name, self.reorder = name, reorder

    def pieces(self, arch: HFArchitecture, tensors: Sequence[torch.Tensor], rank: int, size: int,
               padded_vocab: int) -> Pieces:
        # lazy: import cost: memory --hf plans without torch (views imports it)
        from megatron_rl_patches.inference.loading.hf.families.views import row_numbers, rows_in_order, whole

        t = tensors[0]
        return whole(rows_in_order(t, self.reorder(arch, row_numbers(t)), rank, size))


MLA_Q = register(RotaryRows("mla_q", query_rows))  # q_proj / q_b_proj
MLA_KV_DOWN = register(RotaryRows("mla_kv_down", kv_down_rows))  # kv_a_proj_with_mqa (megatron-core gathers it)
