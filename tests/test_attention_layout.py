"""The one adapter between megatron-core's core-attention layout [s, b, heads, d] and torch SDPA's
[b, heads, s, d] (`model.attention_layout`): grouped key / value heads, the squeezed packed batch and
the way back, against a float64 attention written out by hand."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.model.attention_layout import heads_first, kv_heads_repeated, sequence_first, with_batch


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Causal attention in float64, megatron's layout in and out, each query head on its own group."""
    rows, batch, heads, width = query.shape
    per_group = heads // key.size(2)
    out = torch.empty(rows, batch, heads, value.size(-1), dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            q, k, v = query[:, b, h].double(), key[:, b, h // per_group].double(), value[:, b, h // per_group].double()
            scores = (q @ k.T) / width ** 0.5
            scores = scores.masked_fill(~torch.ones(rows, rows, dtype=torch.bool).tril(), float("-inf"))
            out[:, b, h] = scores.softmax(-1) @ v
    return out.reshape(rows, batch, -1)


def test_megatron_layout_through_sdpa_and_back_with_grouped_heads():
    torch.manual_seed(0)
    query, key, value = torch.randn(5, 2, 4, 3), torch.randn(5, 2, 2, 3), torch.randn(5, 2, 2, 3)
    q, k, v = heads_first(query, key, value)
    assert q.shape == (2, 4, 5, 3) and k.shape == (2, 2, 5, 3)
    k, v = (kv_heads_repeated(t, q.size(1), "test") for t in (k, v))
    out = sequence_first(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert out.shape == (5, 2, 12)
    torch.testing.assert_close(out.double(), reference(query, key, value), atol=1e-6, rtol=0)


def test_a_squeezed_packed_batch_gets_its_batch_back_and_uneven_groups_are_refused():
    packed = torch.randn(7, 4, 3)
    (restored,) = with_batch(packed)
    assert restored.shape == (7, 1, 4, 3) and torch.equal(restored[:, 0], packed)
    whole = torch.randn(7, 1, 4, 3)
    assert with_batch(whole)[0] is whole
    (first,) = heads_first(whole)
    assert kv_heads_repeated(first, 4, "test") is first  # as many groups as heads: nothing to repeat
    with pytest.raises(ValueError, match=r"^core: 4 query heads do not split into 3 key/value groups$"):
        kv_heads_repeated(torch.randn(1, 3, 7, 3), 4, "core")
