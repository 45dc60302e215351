"""On a CUDA device (`make test-gpu`; skipped elsewhere): ``auto`` picks the Triton kernels, they
match a float64 reference at a mid-size bf16 shape, and the fused head's excess peak memory stays
under 0.1 U (the logits path needs more than 1 U)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import lm_head_log_probs_and_entropy
from megatron_rl_patches.ops import kernels
from megatron_rl_patches.testing.logprob_reference import reference_log_probs

pytestmark = [pytest.mark.gpu, pytest.mark.triton]
CUDA = torch.device("cuda")


def _inputs(T: int, H: int, V: int, seed: int = 0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    hidden = torch.randn(T, H, device=CUDA, generator=g).bfloat16()
    weight = (torch.randn(V, H, device=CUDA, generator=g) * H**-0.5 * 2).bfloat16()
    tokens = torch.randint(0, V - 5, (T,), device=CUDA, generator=g)
    return hidden, weight, tokens, torch.randn(T, device=CUDA, generator=g), torch.randn(T, device=CUDA, generator=g)


def test_auto_picks_the_kernels_on_cuda():
    assert kernels.resolve_backend("auto", CUDA).name == "triton"


def test_kernels_match_float64_at_a_mid_size_shape():
    hidden, weight, tokens, a, b = _inputs(2048, 1024, 32003)
    tau = torch.rand(2048, device=CUDA) + 0.5
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = lm_head_log_probs_and_entropy(h, w, tokens, with_entropy=True, temperature=tau, vocab_size=31998,
                                            backend="triton")
    ((lp * a).sum() + (ent * b).sum()).backward()
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_lp, ref_ent = reference_log_probs(hd @ wd[:31998].t(), tokens, temperature=tau)
    ((ref_lp * a.double()).sum() + (ref_ent * b.double()).sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-4)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-4)
    for got, want in ((h.grad, hd.grad), (w.grad, wd.grad)):
        assert float((got.double() - want).abs().max()) <= 2e-2 * max(1.0, float(want.abs().max()))


def test_fused_excess_peak_is_under_a_tenth_of_the_logits():
    T, H, V = 32768, 512, 65536
    hidden, weight, tokens, a, b = _inputs(T, H, V)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = lm_head_log_probs_and_entropy(h, w, tokens, with_entropy=True, backend="triton")
    ((lp * a).sum() + (ent * b).sum()).backward()
    torch.cuda.synchronize()
    excess = torch.cuda.max_memory_allocated() - base - h.grad.nbytes - w.grad.nbytes
    assert excess <= 0.1 * T * V * 4, f"excess peak {excess / (T * V * 4):.3f} U"


def test_topk_ids_excess_peak_does_not_grow_with_the_rows():
    """The kernel's candidates (k per vocabulary tile) and their merge are made a row block at a
    time: the excess stays within the tile budget whatever T. Before, one launch held every row's
    V·k/BLOCK_N candidates and sorted them: 8.0 U at T = 4096, V = 151936, k = 64 on an H200."""
    from megatron_rl_patches import lm_head_topk_ids

    T, H, V, k = 8192, 512, 65536, 64
    hidden, weight, *_ = _inputs(T, H, V)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ids = lm_head_topk_ids(hidden, weight, k, backend="triton")
    torch.cuda.synchronize()
    excess = torch.cuda.max_memory_allocated() - base - ids.nbytes
    assert excess <= 0.1 * T * V * 4, f"excess peak {excess / (T * V * 4):.3f} U"
    assert torch.equal(ids, lm_head_topk_ids(hidden, weight, k, backend="torch"))


def test_the_gemm_backends_products_take_fp32_output_from_bf16_on_this_torch():
    """The `gemm` route's speed rests on `torch.mm(out_dtype=float32)` from bf16 operands: where this
    torch lacks it the route upcasts every chunk (right, several times slower) and warns once; on the
    GPU check it must not have to."""
    from megatron_rl_patches.ops.kernels.triton.gemm_backend import Fp32Products

    products = Fp32Products()
    a = torch.randn(64, 32, device=CUDA).bfloat16()
    b = torch.randn(48, 32, device=CUDA).bfloat16()
    out = torch.empty(64, 48, device=CUDA)
    products(a, b, out)
    assert products.out_dtype_works
    torch.testing.assert_close(out, a.float() @ b.float().t(), rtol=1e-5, atol=1e-5)
