"""The block prefilter of the top-k id selection (`topk_select.fold_tile` on wide tiles): the k
best values come from the k best blocks by block max, exact against a stable float64 sort in
every dtype, ties across blocks and at the blocks' maxima included."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_patches import lm_head_topk_ids, topk_ids
from megatron_rl_patches.ops import topk_select

BLOCK = topk_select.BLOCK


def _stable(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(x.double(), dim=-1, descending=True, stable=True).indices[:, :k]


@pytest.fixture
def prefilter_calls(monkeypatch):
    """How many tiles went through the prefilter (so a test cannot pass on the plain path)."""
    calls = []
    real = topk_select._block_candidates

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(topk_select, "_block_candidates", counted)
    return calls


def _wide(k: int, extra: int = 0) -> int:
    return topk_select.BLOCKS_PER_SLOT * (k + 1) * BLOCK + extra


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("extra", [0, 5, BLOCK - 1], ids=["whole-blocks", "partial-5", "partial-31"])
def test_few_distinct_values_tie_across_blocks(dtype, k, extra, prefilter_calls):
    """Values from {0..3}: every block's max ties with many others, so the k best blocks are an
    arbitrary pick among equals; the ids must still be the lowest ones holding each value."""
    g = torch.Generator().manual_seed(k * 100 + extra)
    x = torch.randint(0, 4, (37, _wide(k, extra)), generator=g).to(dtype)
    assert torch.equal(topk_ids(x, k), _stable(x, k))
    assert prefilter_calls


@pytest.mark.parametrize("k", [1, 4])
def test_cut_equal_to_a_left_out_block_max_is_reranked(k, prefilter_calls):
    """One value M per block, all equal, the rest lower: the candidates' cut equals the largest
    block max left out. Without marking that row ambiguous the ids would be whichever blocks
    torch.topk picked, not the lowest."""
    n = _wide(k)
    x = torch.zeros(6, n)
    x[:, ::BLOCK] = -1.0  # the block's first column low
    x[:, 7::BLOCK] = 5.0  # one tie at every block's max
    x = x.flip(1).contiguous()  # the ties' lowest ids now sit in the last blocks
    assert torch.equal(topk_ids(x, k), _stable(x, k))
    assert prefilter_calls


def test_distinct_values_random_and_scaled(prefilter_calls):
    g = torch.Generator().manual_seed(7)
    for scale in (1e-3, 3.0, 1e4):
        x = torch.randn(50, 4000, generator=g) * scale
        for k in (1, 5, 20):
            assert torch.equal(topk_ids(x, k), _stable(x, k)), (scale, k)
    assert prefilter_calls


def test_the_largest_values_in_one_block_and_neg_inf_blocks(prefilter_calls):
    """All k best in a single block; whole blocks of -inf (a masked vocabulary range)."""
    k = 6
    x = torch.randn(9, _wide(k, 3), generator=torch.Generator().manual_seed(2))
    x[:, 5 * BLOCK: 5 * BLOCK + k] = 50.0 + torch.arange(k, dtype=x.dtype)
    x[:, : 4 * BLOCK] = -math.inf
    x[::2, 9 * BLOCK:] = -math.inf  # rows with only a few finite blocks
    assert torch.equal(topk_ids(x, k), _stable(x, k))
    assert prefilter_calls


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_bad_value_in_a_block_is_still_a_bad_row(bad, prefilter_calls):
    x = torch.randn(5, _wide(4, 9), generator=torch.Generator().manual_seed(3))
    x[3, 2 * BLOCK + 17] = bad
    with pytest.raises(ValueError, match=r"rows \[3\] contain NaN or \+inf"):
        topk_ids(x, 4)
    x[3, 2 * BLOCK + 17] = 0.0
    x[1] = -math.inf
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        topk_ids(x, 4)
    assert prefilter_calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_tiles_prefiltered_equal_the_logits_op(dtype, prefilter_calls):
    """The fused head's h·Wᵀ tiles (column slices) through the prefilter, ties included."""
    g = torch.Generator().manual_seed(11)
    h = torch.randint(-2, 3, (24, 8), generator=g).to(dtype)
    w = torch.randint(-1, 2, (3000, 8), generator=g).to(dtype)
    for k in (1, 8):
        for chunk in (None, 5):
            assert torch.equal(lm_head_topk_ids(h, w, k, chunk_size=chunk), _stable(h.float() @ w.float().T, k))
    assert prefilter_calls


def test_prefilter_and_plain_path_agree(monkeypatch):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(64, 5000, generator=g) * 2).bfloat16()
    filtered = topk_ids(x, 10)
    monkeypatch.setattr(topk_select, "BLOCKS_PER_SLOT", 10**9)  # every tile on the plain path
    assert torch.equal(topk_ids(x, 10), filtered)
