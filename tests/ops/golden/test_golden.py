"""Bitwise equality with the results recorded from the reference commit (golden_cases.py): the
validation added for bad inputs and the top-k OPD split (topk_logprobs + topk_kl) change no bit.
The products run in a fixed order, MKL's vector math on one code path (a fresh process) and the
results are recorded per CPU capability, so this holds on every CPU of a recorded capability at
every thread count (docs/testing.md, "Golden results")."""
from __future__ import annotations

import functools

import pytest
import torch
from kit import golden_cases
from kit.fixed_gemm import FixedOrderGemm

RECORDED, BITWISE = golden_cases.recorded(golden_cases.SINGLE)


@functools.cache
def now() -> dict[str, torch.Tensor]:
    """Today's cases, MKL's code path pinned (a spawned process): computed by the first test that
    runs, not at import, which every lane's workers do at collection, deselected or not."""
    return golden_cases.pinned(golden_cases.single_cases, 1)[0]


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_bitwise_equal_to_the_reference(key):
    golden_cases.assert_same(RECORDED[key], now()[key], key, BITWISE)


def test_the_fused_heads_bits_are_the_same_at_one_and_two_threads():
    """The keys that failed at OMP_NUM_THREADS=1 (MKL's sgemm splits by threads): under the golden
    cases' fixed-order products, forward and backward give the same bits at 1 and 2 threads, and
    the backward's products ran there too (autograd runs a backward without a torch function mode)."""
    from megatron_rl_patches.ops.lm_head import lm_head_topk_logprobs

    g = torch.Generator().manual_seed(5)
    hidden0, weight0 = torch.randn(21, 9, generator=g) * 2, torch.randn(47, 9, generator=g)
    tau, ids = torch.rand(21, generator=g) + 0.5, torch.stack([torch.randperm(44, generator=g)[:4] for _ in range(21)])
    threads, results = torch.get_num_threads(), []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            with FixedOrderGemm() as fixed:
                hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
                logp, tail = lm_head_topk_logprobs(hidden, weight, ids, temperature=tau, vocab_size=44, chunk_size=6)
                forward = fixed.products
                (logp.sum() * 0.5 + tail.sum()).backward()
            assert forward > 0 and fixed.products > forward, (forward, fixed.products)
            results.append((logp.detach(), tail.detach(), hidden.grad, weight.grad))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(one, two) for one, two in zip(*results))
