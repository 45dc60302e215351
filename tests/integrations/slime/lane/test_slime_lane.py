"""slime 624b824a's real train() / forward_only / train_one_step with the package's slime patches."""
from __future__ import annotations

import functools
import logging
import math

import pytest
import torch

from megatron_rl_patches._log import forget_warnings
from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.slime

import megatron_rl_patches  # noqa: E402

FUSED = ["slime_fused", "gpt_output_processor"]
TEMPERATURE = 0.7


def _kit():
    import slime_kit

    return slime_kit


def test_reentry_three_rollouts_unpatched_fails_at_rollout_two(slime_cpu):
    kit = _kit()
    with kit.slime_session() as args:
        model, optimizer, scheduler = kit.build(args)
        kit.train(args, 0, model, optimizer, scheduler, kit.rollout(0))
        with pytest.raises(AssertionError, match="no_sync_func"):
            kit.train(args, 1, model, optimizer, scheduler, kit.rollout(1))


def test_reentry_three_rollouts_patched(slime_cpu):
    kit = _kit()
    megatron_rl_patches.apply(only=["train_reentry", *FUSED])
    with kit.slime_session() as args:
        model, optimizer, scheduler = kit.build(args)
        before = [p.detach().clone() for p in model[0].parameters()]
        for rollout_id in range(3):
            kit.train(args, rollout_id, model, optimizer, scheduler, kit.rollout(rollout_id))
        assert any(not torch.equal(a, b) for a, b in zip(before, model[0].parameters()))


def _forward_and_step(kit, fused: bool):
    """forward_only log-probs / entropy, then one train_one_step from the same fresh weights."""
    from slime.backends.megatron_utils import model as slime_model

    if fused:
        megatron_rl_patches.apply(only=FUSED)
    with kit.slime_session(rollout_temperature=TEMPERATURE, use_rollout_entropy=True, entropy_coef=0.01,
                           log_probs_chunk_size=4) as args:
        model, optimizer, scheduler = kit.build(args)
        data = kit.rollout(0)
        out = kit.log_probs(args, model, data)
        ref = kit.reference(model, data, TEMPERATURE)
        step_data = kit.rollout(0, [lp + 0.05 for lp in out["log_probs"]])
        for chunk in model:
            chunk.train()
        losses, grad_norm = slime_model.train_one_step(args, 0, 0, kit.iterators(step_data), model, optimizer,
                                                       scheduler, 2, 4)
        weights = [p.detach().clone() for p in model[0].parameters()]
    megatron_rl_patches.revert()
    return out, ref, losses, grad_norm, weights


@layouts.mark("thd")  # slime packs every micro-batch as thd
def test_fused_matches_slimes_logits_path_and_float64(slime_cpu):
    kit = _kit()
    plain, ref, plain_losses, plain_norm, plain_weights = _forward_and_step(kit, fused=False)
    fused, _, fused_losses, fused_norm, fused_weights = _forward_and_step(kit, fused=True)
    for key, expected in (("log_probs", ref[0]), ("entropy", ref[1])):
        for a, b, r in zip(plain[key], fused[key], expected):
            assert a.shape == b.shape == r.shape
            torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
            torch.testing.assert_close(b.double(), r, rtol=0, atol=2e-5)
    assert set(fused_losses) == set(plain_losses)
    for key in plain_losses:
        torch.testing.assert_close(torch.as_tensor(fused_losses[key]), torch.as_tensor(plain_losses[key]),
                                   rtol=1e-5, atol=2e-6)
    assert abs(fused_norm - plain_norm) <= 1e-5 * max(1.0, plain_norm)
    # weights after Adam's first step (lr·g/(|g| + eps)): elements whose gradient is near eps amplify fp32 noise
    for a, b in zip(plain_weights, fused_weights):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def _watched_forward_and_train(kit, patches: list[str]):
    """The [T, V] watch over slime's forward_only and train() with `patches` applied (chunks of 4 rows)."""
    from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

    if patches:
        megatron_rl_patches.apply(only=patches)
    with kit.slime_session(log_probs_chunk_size=4) as args:
        model, optimizer, scheduler = kit.build(args)
        data = kit.rollout(0)
        with VocabWideTensors(vocab=kit.VOCAB) as watch:
            kit.log_probs(args, model, data)
            kit.train(args, 0, model, optimizer, scheduler, kit.rollout(0))
    return watch


def _rows(shape: tuple[int, ...]) -> int:
    """Vocabulary-wide rows of a tensor of `shape` ([s, b, V] and [b, s, V] alike)."""
    return math.prod(shape[:-1])


def test_fused_route_builds_no_vocab_wide_rows(slime_cpu):
    watch = _watched_forward_and_train(_kit(), FUSED)
    assert watch.largest_shape and _rows(watch.largest_shape) <= 4, watch.as_dict()


def test_vocab_watch_sees_the_logits_of_slimes_unpatched_route(slime_cpu):
    """The negative control: the same watch on slime's own route sees its [1, T, V] logits (T: a
    micro-batch's packed tokens), slime's log-prob chunking notwithstanding; a blind watch fails here."""
    kit = _kit()
    data = kit.rollout(0)
    packed = max(sum(data["total_lengths"][i] for i in batch) for batch in data["micro_batch_indices"])
    watch = _watched_forward_and_train(kit, [])
    assert _rows(watch.largest_shape) >= packed, (packed, watch.as_dict())


@pytest.mark.parametrize("feature, values, env", [
    ("critic's value head", {"loss_type": "value_loss"}, {}),
])
def test_fallback_logs_the_feature_once_and_keeps_slimes_numbers(slime_cpu, caplog, monkeypatch, feature, values,
                                                                 env):

    kit = _kit()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    forget_warnings()  # each fallback says its line again
    megatron_rl_patches.apply(only=FUSED)
    with kit.slime_session(**values) as args:
        model, _, _ = kit.build(args)
        data = kit.rollout(0)
        with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
            first = kit.log_probs(args, model, data)
            kit.log_probs(args, model, data)
        ref = kit.reference(model, data, 1.0)
    lines = [r.getMessage() for r in caplog.records if "slime_fused:" in r.getMessage()]
    assert len(lines) == 1 and feature in lines[0], lines
    for a, r in zip(first["log_probs"], ref[0]):
        torch.testing.assert_close(a.double(), r, rtol=0, atol=2e-5)


def test_bshd_batch_falls_back_with_one_log_line_and_slimes_numbers(slime_cpu, caplog, monkeypatch):
    """slime 624b824a packs thd; a bshd micro-batch (a fork's get_batch without packing: here slime's
    batch with its packed_seq_params dropped) goes to slime's own logits path, said once."""
    from slime.backends.megatron_utils import model as slime_model


    kit = _kit()
    get_batch = slime_model.get_batch

    @functools.wraps(get_batch)  # slime's signature, which slime_fused's guard checks
    def bshd_batch(*args, **kwargs):
        batch = get_batch(*args, **kwargs)
        batch["packed_seq_params"] = None
        return batch

    monkeypatch.setattr(slime_model, "get_batch", bshd_batch)
    forget_warnings()  # each fallback says its line again
    with kit.slime_session(rollout_temperature=TEMPERATURE) as args:
        model, _, _ = kit.build(args)
        data = kit.rollout(0)
        plain = kit.log_probs(args, model, data)
        megatron_rl_patches.apply(only=FUSED)
        try:
            with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
                fused = kit.log_probs(args, model, data)
                kit.log_probs(args, model, data)
        finally:
            megatron_rl_patches.revert()
    lines = [r.getMessage() for r in caplog.records if "slime_fused:" in r.getMessage()]
    assert len(lines) == 1 and "bshd" in lines[0], lines
    for a, b in zip(plain["log_probs"], fused["log_probs"], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
