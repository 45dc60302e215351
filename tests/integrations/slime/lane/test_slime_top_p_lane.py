"""slime 624b824a's top-p replay (`--rollout-top-p` < 1) on slime_fused: slime's real forward_only
(`use_rollout_top_p_replay=True`) and train_one_step, unpatched vs fused, against float64: the
nuclei are strict subsets of the vocabulary, some without the sampled token, some empty, and one
sample's offsets stop before its last response tokens (those keep the full vocabulary)."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.slime


def _kits():
    import slime_kit
    import slime_top_p

    return slime_kit, slime_top_p


@layouts.mark("thd")
def test_top_p_replay_fused_matches_slime_and_float64(slime_cpu, caplog):
    kit, top_p = _kits()
    plain, logps, data, plain_losses, plain_norm, plain_weights, plain_watch = top_p.forward_and_step(kit, False)
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        fused, _, _, fused_losses, fused_norm, fused_weights, fused_watch = top_p.forward_and_step(kit, True)
    assert not [r for r in caplog.records if "slime_fused:" in r.getMessage()]  # no fallback
    want_lp = top_p.renormalized(logps, data)
    want_ent = [-(lp.exp() * lp).sum(-1) for lp in logps]  # entropy stays unmasked
    full = [lp.gather(-1, t[-r:, None])[:, 0] for lp, t, r in zip(logps, data["tokens"], data["response_lengths"])]
    changed = 0
    for key, want in (("log_probs", want_lp), ("entropy", want_ent)):
        for a, b, w in zip(plain[key], fused[key], want, strict=True):
            assert a.shape == b.shape == w.shape
            torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
            torch.testing.assert_close(b.double(), w, rtol=0, atol=2e-5)
    for b, f in zip(fused["log_probs"], full):
        changed += int(((b.double() - f).abs() > 1e-3).sum())
    assert changed >= 10  # the nuclei renormalize (a route ignoring them fails above)
    assert fused["log_probs"][-1][-1].double() == pytest.approx(float(full[-1][-1]), abs=2e-5)  # past the offsets
    for key in plain_losses:
        torch.testing.assert_close(torch.as_tensor(fused_losses[key]), torch.as_tensor(plain_losses[key]),
                                   rtol=1e-5, atol=2e-6)
    assert abs(fused_norm - plain_norm) <= 1e-5 * max(1.0, plain_norm)
    # Adam's first step moves each weight by ~lr = 0.01 (lr·g/(|g| + eps)): a gradient near eps
    # amplifies fp32 noise, a wrong gradient flips the step (0.02)
    for a, b in zip(plain_weights, fused_weights):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
    # slime's own route builds its [T, V] keep-mask and logits; the fused one no vocabulary-wide row
    packed = min(sum(data["total_lengths"][i] for i in batch) for batch in data["micro_batch_indices"])
    assert math.prod(plain_watch.largest_shape[:-1]) >= packed, plain_watch.as_dict()
    assert fused_watch.largest_shape and math.prod(fused_watch.largest_shape[:-1]) <= 4, fused_watch.as_dict()


@pytest.mark.parametrize("tensor, context, allgather", [
    pytest.param(2, 1, False, marks=layouts.mark("tp2", "thd"), id="tp2"),
    pytest.param(1, 2, False, marks=layouts.mark("cp2-zigzag", "thd"), id="cp2"),
    pytest.param(1, 2, True, marks=layouts.mark("cp2-allgather", "thd"), id="cp2-allgather")])
def test_top_p_replay_fused_matches_slime_at_tp2_and_cp2(slime_cpu, tensor, context, allgather):
    """Two gloo ranks: at TP=2 the vocabulary (and each nucleus) is split over the shards (the kept
    logits joined by one all-reduce), at CP=2 zigzag each rank holds two chunks of every sample, with
    `--allgather-cp` (the declared DSA world of slime_ranks) a contiguous slice of the packed stream,
    and slime redistributes the log-probs to zigzag rows (the nuclei follow slime's own slicing);
    slime's route and the fused one agree on every rank, and no step falls back."""
    from megatron_rl_patches.testing.multirank import run_multirank

    _, top_p = _kits()
    results = run_multirank(top_p.world_rank, 2, tensor, context, allgather, timeout=300)
    for rank, result in enumerate(results):
        plain, fused = result[False], result[True]
        assert fused["fell_back"] == [], fused["fell_back"]
        for key in ("log_probs", "entropy"):
            for a, b in zip(plain["out"][key], fused["out"][key], strict=True):
                torch.testing.assert_close(b, a, rtol=0, atol=2e-5, msg=f"{key} rank {rank}")
        for key in plain["losses"]:
            torch.testing.assert_close(torch.as_tensor(fused["losses"][key]), torch.as_tensor(plain["losses"][key]),
                                       rtol=1e-5, atol=2e-6)
        assert abs(fused["grad_norm"] - plain["grad_norm"]) <= 1e-5 * max(1.0, plain["grad_norm"])
        for a, b in zip(plain["weights"], fused["weights"], strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
