"""convert.shard_pieces: the slices each source tensor is copied into make, for every rank, exactly
the tensor a fuse-then-chunk reference makes (q/k/v interleaved per query group, gate and up
stacked per shard, the padded vocab's zero rows), while the sources stay views (no copy is made
before the one into the parameter). No megatron-core."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.inference.loading.hf.convert import Source, shard_pieces
from megatron_rl_patches.inference.loading.hf.families import architecture
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config


def _filled(shape, pieces) -> torch.Tensor:
    target = torch.full(shape, float("nan"))
    for where, value in pieces:
        if value is None:
            where(target).zero_()
        else:
            where(target).copy_(value)
    return target


def _reference(kind, tensors, arch, rank, size, padded):
    if kind == "qkv":
        heads, hd = arch.num_kv_heads, arch.head_dim
        r = size // heads if size > heads else 1  # fewer heads than ranks: each repeated (kv_heads.py)
        q, k, v = tensors
        k, v = (t.reshape(heads, hd, -1).repeat_interleave(r, dim=0) for t in (k, v))
        fused = torch.cat([q.reshape(heads * r, -1, q.shape[1]), k, v], dim=1).reshape(-1, q.shape[1])
        return fused.chunk(size, dim=0)[rank]
    if kind == "gated":
        return torch.cat([t.chunk(size, dim=0)[rank] for t in tensors], dim=0)
    if kind == "vocab":
        table = tensors[0]
        padded_table = torch.cat([table, table.new_zeros(padded - table.shape[0], table.shape[1])])
        return padded_table.chunk(size, dim=0)[rank]
    if kind == "row":
        return tensors[0].chunk(size, dim=1)[rank]
    return tensors[0].chunk(size, dim=0)[rank] if kind == "column" else tensors[0]


@pytest.mark.parametrize("kv_heads", [2, 1])  # 1 head at TP=2: repeated, a group per rank
@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("kind", ["qkv", "gated", "vocab", "row", "column", "replicate"])
def test_pieces_fill_what_fuse_then_chunk_makes(kind, size, kv_heads):
    arch = architecture(tiny_hf_config("qwen3", num_key_value_heads=kv_heads))
    gen = torch.Generator().manual_seed(0)
    hidden, hd = arch.hidden_size, arch.head_dim
    tensors = {
        "qkv": [torch.randn(arch.num_heads * hd, hidden, generator=gen),
                torch.randn(kv_heads * hd, hidden, generator=gen), torch.randn(kv_heads * hd, hidden, generator=gen)],
        "gated": [torch.randn(48, hidden, generator=gen), torch.randn(48, hidden, generator=gen)],
        "vocab": [torch.randn(1001, hidden, generator=gen)],
    }.get(kind, [torch.randn(48, hidden, generator=gen)])
    padded = 1024
    for rank in range(size):
        shape, pieces = shard_pieces(arch, Source(("x",), kind, False), tensors, rank, size, padded)
        want = _reference(kind, tensors, arch, rank, size, padded)
        assert shape == tuple(want.shape)
        assert torch.equal(_filled(shape, pieces), want)
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        # no intermediate tensor: every value is a source's view
        assert all(value is None or value.untyped_storage().data_ptr() in storages for _, value in pieces)


def test_a_wrong_layout_is_caught():
    """Negative control: the per-group layout differs from plain q, k, v stacking."""
    arch = architecture(tiny_hf_config("qwen3"))
    q, k, v = torch.randn(32, 32), torch.randn(16, 32), torch.randn(16, 32)
    shape, pieces = shard_pieces(arch, Source(("x",), "qkv", False), [q, k, v], 0, 1, 0)
    assert not torch.equal(_filled(shape, pieces), torch.cat([q, k, v]))
