"""lm_head_divergence against the dense float64 route: every divergence, one and three teachers,
keep_mask, per-token temperature, vocabulary padding, vocabulary tiles small enough that the online
rescaling runs; float64 and float32 inputs; teachers get no gradient; no [T, V] tensor."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_rl_patches import lm_head_divergence
from megatron_rl_patches.ops.kernels import torch_tiles
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

sys.path.insert(0, str(Path(__file__).parent))
from divergence_cases import (  # noqa: E402
    DIVERGENCES,
    TILE_BYTES,
    V_PADDED,
    T,
    assert_float32,
    assert_float64,
    is_nontrivial,
    make_inputs,
    ours,
    reference,
)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(torch_tiles, "CPU_TILE_BYTES", TILE_BYTES)


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("n_teachers", [1, 3])
@pytest.mark.parametrize("keep,per_token", [(False, False), (True, False), (False, True)])
def test_float64_matches_dense(divergence, n_teachers, keep, per_token):
    hidden, weight, teachers, keep_mask, tau, grad_out = make_inputs(n_teachers, keep=keep, per_token_tau=per_token)
    want = reference(divergence, hidden, weight, teachers, keep_mask, tau, grad_out)
    assert is_nontrivial(want[0])
    assert_float64(ours(divergence, hidden, weight, teachers, keep_mask, tau, grad_out), want, divergence)


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("n_teachers", [1, 2])
def test_float32_matches_dense(divergence, n_teachers):
    hidden, weight, teachers, keep_mask, tau, grad_out = make_inputs(n_teachers, dtype=torch.float32, seed=3)
    want = reference(divergence, hidden, weight, teachers, keep_mask, tau, grad_out)
    got = ours(divergence, hidden, weight, teachers, keep_mask, tau, grad_out)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_float32(got, want, divergence)


@pytest.mark.parametrize("beta,alpha,same_as", [(0.0, 0.2, "forward_kl"), (1.0, 0.2, "reverse_kl")])
def test_jsd_ends_are_the_kls(beta, alpha, same_as):
    hidden, weight, teachers, _, tau, _ = make_inputs(1)
    (th, tw), = teachers
    jsd = lm_head_divergence(hidden, weight, th, tw, divergence="jsd", beta=beta, temperature=tau)
    kl = lm_head_divergence(hidden, weight, th, tw, divergence=same_as, temperature=tau)
    assert torch.equal(jsd, kl)


def test_zero_for_identical_models_and_teachers_get_no_gradient():
    hidden, weight, _, _, _, _ = make_inputs(1)
    th, tw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    for divergence in DIVERGENCES:
        value = lm_head_divergence(hidden, weight, th, tw, divergence=divergence)
        assert float(value.abs().max()) <= 1e-12, divergence
        assert not value.requires_grad  # the student does not require grad: nothing to differentiate
    h = hidden.clone().requires_grad_()
    lm_head_divergence(h, weight, th, tw, divergence="jsd").sum().backward()
    assert th.grad is None and tw.grad is None and h.grad is not None


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_no_vocabulary_wide_tensor(monkeypatch, divergence):
    monkeypatch.setattr(torch_tiles, "CPU_TILE_BYTES", 4 * 4 * 32)
    hidden, weight, teachers, _, _, _ = make_inputs(2)
    h = hidden.clone().requires_grad_()
    with VocabWideTensors(V_PADDED) as watch:
        value = lm_head_divergence(h, weight, [t[0] for t in teachers], [t[1] for t in teachers],
                                   divergence=divergence, chunk_size=4)
        value.sum().backward()
    assert watch.largest_bytes == 0 and h.grad is not None  # tiles of 32 columns: no [., V] tensor at all
    assert value.shape == (T,)


@layouts.mark("bf16")
def test_bfloat16_inputs_match_their_float32_logits_and_empty_rows_work():
    hidden, weight, teachers, _, _, grad_out = make_inputs(2, dtype=torch.float32)
    (th0, tw0), (th1, tw1) = teachers
    bf = [t.bfloat16() for t in (hidden, weight, th0, tw0, th1, tw1)]
    h = bf[0].clone().requires_grad_()
    value = lm_head_divergence(h, bf[1], [bf[2], bf[4]], [bf[3], bf[5]], divergence="jsd")
    value.sum().backward()
    assert value.dtype == torch.float32 and h.grad.dtype == torch.bfloat16 and torch.isfinite(h.grad.float()).all()
    # the same bf16 values in fp32: only the bf16 rounding of each logits tile differs
    want = lm_head_divergence(*(t.float() for t in bf[:2]), [bf[2].float(), bf[4].float()],
                              [bf[3].float(), bf[5].float()], divergence="jsd")
    assert float((value.detach() - want).abs().max()) <= 2e-2 * float(want.abs().max())
    empty = torch.zeros(0, hidden.size(1), requires_grad=True)
    out = lm_head_divergence(empty, weight, th0[:0], tw0, divergence="tv")
    out.sum().backward()
    assert out.shape == (0,) and empty.grad.shape == empty.shape


def test_mixed_kl_against_one_teacher_takes_one_pass(monkeypatch):
    """mixed_kl folds both KLs' cross terms in pass 1 (as forward and reverse KL fold one): its
    forward recomputes each model's tiles once, a divergence with a second pass (jsd) twice; with
    two teachers mixed_kl needs the mixture's normalizer first and takes two passes too."""
    calls = []
    real = torch_tiles.logits_tile
    monkeypatch.setattr(torch_tiles, "logits_tile", lambda *a: calls.append(1) or real(*a))
    hidden, weight, teachers, _, tau, _ = make_inputs(2)

    def tiles_of(divergence: str, n: int) -> int:
        calls.clear()
        ths, tws = [t[0] for t in teachers[:n]], [t[1] for t in teachers[:n]]
        lm_head_divergence(hidden, weight, ths, tws, divergence=divergence, beta=0.3, temperature=tau)
        return len(calls)

    one_pass = tiles_of("forward_kl", 1)
    assert one_pass > 0
    assert tiles_of("mixed_kl", 1) == one_pass == tiles_of("reverse_kl", 1)
    assert tiles_of("jsd", 1) == 2 * one_pass
    assert tiles_of("mixed_kl", 2) == tiles_of("jsd", 2) == 3 * one_pass  # 3 models, 2 passes
