"""The ``gemm`` backend (the vendor's GEMM into fp32 buffers, then the Triton row passes) against
float64 through the public ops: log-prob ± entropy ± keep mask ± per-row temperature ± vocabulary
padding, top-k log-probs + tail, top-k ids with ties, every gradient; several row chunks and
vocabulary slices (the budgets of tiny inputs cut them small); its buffers within their share of
U. CUDA when present, else CPU under Triton's interpreter (the GEMM is then the CPU BLAS)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import triton_kit as kit  # noqa: E402

from megatron_rl_patches import lm_head_log_probs_and_entropy, lm_head_topk_ids  # noqa: E402
from megatron_rl_patches.ops import kernels  # noqa: E402

pytestmark = pytest.mark.triton
kit.require_kernels()

V, PADDED = 72, 67
LOG_PROB_NAMES = ("log_probs", "entropy", "grad_hidden", "grad_weight")
CASES = ("entropy-tau-padded", "entropy-mask-tau", "mask-padded-no-entropy", "entropy-grad-only")
_check = kit.check


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_log_prob_and_entropy_match_float64(case, dtype):
    runs = kit.log_prob_case_runs(case, dtype, True, V, PADDED, ("gemm", None))
    _check(runs["gemm"], runs[None], LOG_PROB_NAMES, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_topk_log_probs_and_tail_match_float64(dtype):
    x = kit.make_inputs(dtype, V=V, n_valid=PADDED, seed=1)
    run = dict(fused=True, dtype=dtype, n_valid=PADDED, grads=(0.3, 1.0))
    _check(kit.topk_run(x, backend="gemm", **run), kit.topk_run(x, backend=None, **run),
           ("topk_log_probs", "tail", "grad_hidden", "grad_weight"), dtype)


def test_topk_ids_equal_a_stable_sort_ties_included():
    """Integer-valued h and W (exact logits, ties at every cut), a row mask, three row chunks."""
    g = torch.Generator().manual_seed(1)
    h = torch.randint(-2, 3, (21, 16), generator=g).float()
    w = torch.randint(-1, 2, (53, 16), generator=g).float()
    want = torch.sort(h.double() @ w.double().T, dim=1, descending=True, stable=True).indices
    for k in (1, 4, 12):
        got = lm_head_topk_ids(h.to(kit.DEVICE), w.to(kit.DEVICE), k, chunk_size=8, backend="gemm").cpu()
        assert torch.equal(got, want[:, :k]), k
    rows = torch.arange(21) % 3 == 0
    got = lm_head_topk_ids(h.to(kit.DEVICE), w.to(kit.DEVICE), 4, row_mask=rows.to(kit.DEVICE), chunk_size=8,
                           backend="gemm")
    assert torch.equal(got.cpu()[rows], want[rows, :4]) and bool((got.cpu()[~rows] == 0).all())


def test_the_targets_logit_is_the_fp32_gemm_not_a_bf16_rounding():
    """bf16 inputs whose logits are not bf16 numbers: the log-prob is the float64 one to fp32
    rounding (a logit read back from a bf16 buffer is off by up to 2^-8 of its size)."""
    x = kit.make_inputs(torch.bfloat16, T=8, H=64, V=40, n_valid=40, seed=4)
    h, w = (x.hidden * 7).to(torch.bfloat16), x.weight.to(torch.bfloat16)
    lp, _ = lm_head_log_probs_and_entropy(h.to(kit.DEVICE), w.to(kit.DEVICE), x.tokens.to(kit.DEVICE),
                                          backend="gemm")
    want = torch.log_softmax(h.double() @ w.double().T, -1).gather(1, x.tokens[:, None])[:, 0]
    rounded = torch.log_softmax((h @ w.T).double(), -1).gather(1, x.tokens[:, None])[:, 0]
    assert float((lp.cpu().double() - want).abs().max()) < 1e-5
    assert float((rounded - want).abs().max()) > 1e-3  # the control: a bf16 logits buffer is visibly off


def test_the_choice_for_cuda_is_one_named_place(monkeypatch):
    """``auto`` on CUDA picks CUDA_DEFAULT (the one place to flip after a GPU run), CPU stays torch."""
    from megatron_rl_patches.ops.kernels import triton as triton_kernels

    assert triton_kernels.CUDA_DEFAULT == "triton"
    cuda = torch.device("cuda")
    for name in ("triton", "gemm", "torch"):
        monkeypatch.setattr(triton_kernels, "CUDA_DEFAULT", name)
        assert kernels.resolve_backend("auto", cuda, torch.bfloat16).name == name
    assert kernels.resolve_backend("auto", torch.device("cpu")).name == "torch"


@pytest.mark.slow  # 48 interpreter launches under a dispatch mode: ~10 s of one core
def test_forward_and_backward_buffers_stay_a_share_of_u():
    """The route's own tensors (counted on CPU) within 0.1 U = T·V·4·0.1 beyond the inputs, the
    outputs and the two gradients, forward and backward (H/V_local = 1/32; 16 row chunks forward,
    32 vocabulary slices backward: 0.093 U measured, a [T, V] buffer anywhere is 1 U)."""
    from megatron_rl_patches.ops.kernels.triton import gemm_backend

    T, H, Vs = 256, 16, 512
    g = torch.Generator().manual_seed(5)
    h = torch.randn(T, H, generator=g).requires_grad_()
    w = (torch.randn(Vs, H, generator=g) * H**-0.5).requires_grad_()
    tokens = torch.randint(0, Vs, (T,), generator=g)
    u = T * Vs * 4
    assert gemm_backend.forward_chunk_rows(T, Vs, torch.device("cpu"), None) == T // 16
    with kit.LiveBytes(h, w, tokens) as counted:
        lp, ent = lm_head_log_probs_and_entropy(h, w, tokens, with_entropy=True, backend="gemm")
        (lp.sum() + ent.sum()).backward()
    kept = h.grad.nbytes + w.grad.nbytes + lp.nbytes + ent.nbytes
    assert (counted.peak - kept) / u <= 0.1, f"excess {(counted.peak - kept) / u:.3f} U"
