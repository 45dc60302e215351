"""The Triton kernels against float64 references and the torch tiles, through the public ops:
log-prob ± entropy ± keep mask ± per-row temperature ± vocabulary padding, top-k log-probs +
tail, both sources (logits, hidden states), fp32 and bf16 inputs, values and every gradient.

CUDA when present (the GPU lane), else CPU under Triton's interpreter (TRITON_INTERPRET=1 set
before the kernels are imported: the Makefile exports it for the 3.12 lane); small shapes.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import triton_kit as kit  # noqa: E402

from megatron_rl_patches.testing.logprob_reference import reference_log_probs  # noqa: E402

pytestmark = pytest.mark.triton
kit.require_kernels()

V, PADDED = 72, 67  # the weight's rows; the valid vocabulary of the padded cases (a partial last tile)
VALUE_TOL, GRAD_TOL = kit.VALUE_TOL, kit.GRAD_TOL
LOG_PROB_NAMES, LOG_PROB_CASES = kit.LOG_PROB_NAMES, kit.LOG_PROB_CASES
_check = kit.check


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize("case", list(LOG_PROB_CASES))
def test_log_prob_and_entropy_kernels_match_float64_and_torch(case, fused, dtype):
    # bf16 torch tiles round the recomputed logits to bf16: compared in fp32 or on logits only
    with_torch = dtype == torch.float32 or not fused
    runs = kit.log_prob_case_runs(case, dtype, fused, V, PADDED, ("triton", None, "torch") if with_torch
                                  else ("triton", None))
    _check(runs["triton"], runs[None], LOG_PROB_NAMES, dtype)
    if with_torch:
        _check(runs["triton"], runs["torch"], LOG_PROB_NAMES, dtype)


@pytest.mark.parametrize("grads", [(0.3, 1.0), (1.0, 0.0), (0.0, 1.0)], ids=["both", "logp", "tail"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "hidden"])
def test_topk_kernels_match_float64_and_torch(fused, dtype, grads):
    x = kit.make_inputs(dtype, V=V, n_valid=PADDED, seed=1)
    kwargs = dict(fused=fused, dtype=dtype, n_valid=PADDED, grads=grads)
    got = kit.topk_run(x, backend="triton", **kwargs)
    names = ("topk_log_probs", "tail", "grad_0", "grad_1")
    _check(got, kit.topk_run(x, backend=None, **kwargs), names, dtype)
    if dtype == torch.float32 or not fused:
        _check(got, kit.topk_run(x, backend="torch", **kwargs), names, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hidden_backward_in_many_column_blocks_matches(dtype):
    """chunk_size caps the dz block (chunk_size·V entries): here 4·67/24 -> 11 columns, 7 blocks,
    each adding to dh and writing its own rows of dW."""
    x = kit.make_inputs(dtype, V=V, n_valid=PADDED, seed=8)
    kwargs = dict(fused=True, dtype=dtype, entropy=True, masked=True, row_tau=True, n_valid=PADDED)
    want = kit.log_prob_run(x, backend=None, **kwargs)
    _check(kit.log_prob_run(x, backend="triton", chunk_size=4, **kwargs), want, LOG_PROB_NAMES, dtype)


def test_inplace_backward_writes_the_logits_storage_and_matches():
    x = kit.make_inputs(torch.float32, V=V, n_valid=PADDED, seed=2)
    kwargs = dict(fused=False, dtype=torch.float32, entropy=True, masked=False, row_tau=True, n_valid=PADDED)
    want = kit.log_prob_run(x, backend="triton", **kwargs)
    leaf = (x.hidden.float() @ x.weight.float().t()).to(kit.DEVICE).requires_grad_()
    logits = leaf * 1.0  # a non-leaf, as the model's output is
    lp, ent = kit.log_probs_and_entropy(logits, x.tokens.to(kit.DEVICE), with_entropy=True, vocab_size=PADDED,
                                        temperature=x.tau.to(kit.DEVICE), inplace_backward=True, backend="triton")
    ((lp * x.a.to(lp)).sum() + (ent * x.b.to(ent)).sum()).backward()
    assert torch.equal(logits.detach(), leaf.grad)  # the logits' storage now holds their gradient
    kit.assert_close([leaf.grad.double().cpu()], want[2:], ("grad_logits",), 1e-6)
    assert bool((leaf.grad[:, PADDED:] == 0).all())


def test_near_certain_targets_keep_their_tiny_log_probs_and_gradients():
    """p(target) -> 1: log p ~ -1e-9 and a·(1 - p) must stay exact (expm1, not 1 - e^x)."""
    x = kit.make_inputs(torch.float32, V=V, seed=3)
    logits = x.hidden.float() @ x.weight.float().t()
    logits[torch.arange(logits.size(0)), x.tokens] += 25.0
    out = {}
    for backend in ("torch", "triton"):
        leaf = logits.clone().to(kit.DEVICE).requires_grad_()
        lp, _ = kit.log_probs_and_entropy(leaf, x.tokens.to(kit.DEVICE), backend=backend)
        lp.sum().backward()
        out[backend] = (lp.double().cpu(), leaf.grad.double().cpu())
    ref, _ = reference_log_probs(logits, x.tokens)
    assert float(ref.max()) < -1e-12 and float(ref.min()) > -1e-4  # tiny, yet far from 0 in fp32 ulps
    torch.testing.assert_close(out["triton"][0], ref, rtol=1e-3, atol=0)
    target_grad = out["triton"][1].gather(1, x.tokens[:, None]).squeeze(1)
    torch.testing.assert_close(target_grad, -torch.expm1(ref), rtol=1e-3, atol=0)
    torch.testing.assert_close(out["triton"][1], out["torch"][1], rtol=1e-4, atol=1e-12)


def test_bad_rows_are_reported_as_on_the_torch_tiles():
    x = kit.make_inputs(torch.float32, V=V, seed=4)
    logits = x.hidden.float() @ x.weight.float().t()
    logits[3, 10] = float("nan")
    logits[5] = -float("inf")
    messages = []
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError) as info:
            kit.log_probs_and_entropy(logits.to(kit.DEVICE), x.tokens.to(kit.DEVICE), with_entropy=True,
                                      backend=backend)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "rows [3]" in messages[1]


def test_float64_inputs_take_the_torch_tiles_bit_for_bit():
    x = kit.make_inputs(torch.float64, V=V, n_valid=PADDED, seed=5)
    kwargs = dict(fused=True, dtype=torch.float64, entropy=True, masked=True, row_tau=True, n_valid=PADDED)
    got, want = kit.log_prob_run(x, backend="triton", **kwargs), kit.log_prob_run(x, backend="torch", **kwargs)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_vocabulary_splits_merge_like_one_pass():
    """The forward grid's vocabulary splits (several here: V spans many tiles) merge to the
    statistics of one walk: the torch tiles' values for a wide row."""
    from megatron_rl_patches.ops.kernels.triton import launch

    x = kit.make_inputs(torch.float32, T=16, V=300, n_valid=290, seed=6)
    b = launch.blocks(kit.DEVICE, fused=False)
    assert launch.splits_for(16, 290, b, kit.DEVICE) > 1 or kit.DEVICE.type == "cuda"
    kwargs = dict(fused=False, dtype=torch.float32, entropy=True, masked=True, row_tau=True, n_valid=290)
    _check(kit.log_prob_run(x, backend="triton", **kwargs), kit.log_prob_run(x, backend=None, **kwargs),
           LOG_PROB_NAMES, torch.float32)
