"""slime 624b824a's top-p replay (`--rollout-top-p` < 1) on slime_fused: slime's real forward_only
(`use_rollout_top_p_replay=True`) and train_one_step, unpatched vs fused, against float64: the
nuclei are strict subsets of the vocabulary, some without the sampled token, some empty, and one
sample's offsets stop before its last response tokens (those keep the full vocabulary)."""
from __future__ import annotations

import logging
import math

import pytest
import torch

pytestmark = pytest.mark.slime

import megatron_rl_patches  # noqa: E402

FUSED = ["slime_fused", "gpt_output_processor"]
TEMPERATURE = 0.7
TOP_P = 0.9


def _kit():
    import slime_kit

    return slime_kit


def nuclei(data: dict, seed: int) -> dict:
    """`data` with slime's per-sample nuclei: response token r keeps ids[offsets[r]:offsets[r+1]]
    (1-9 ids, the sampled token usually among them; every 4th token's nucleus lacks it, every 5th
    is empty); the last sample's offsets cover only its first half."""
    gen = torch.Generator().manual_seed(seed)
    ids_all, offsets_all = [], []
    for s, (tokens, response) in enumerate(zip(data["tokens"], data["response_lengths"])):
        targets = tokens[-response:]
        covered = response // 2 if s == len(data["tokens"]) - 1 else response
        ids, offsets = [], [0]
        for r in range(covered):
            size = int(torch.randint(1, 10, (), generator=gen))
            kept = torch.randperm(_kit().VOCAB, generator=gen)[:size].tolist()
            kept = [i for i in kept if i != int(targets[r])]
            if r % 4 != 3:
                kept.append(int(targets[r]))
            if r % 5 == 4:
                kept = []
            ids += kept
            offsets.append(len(ids))
        ids_all.append(torch.tensor(ids, dtype=torch.int32))
        offsets_all.append(torch.tensor(offsets, dtype=torch.int32))
    return {**data, "rollout_top_p_token_ids": ids_all, "rollout_top_p_token_offsets": offsets_all}


def renormalized(logps: list[torch.Tensor], data: dict) -> list[torch.Tensor]:
    """float64 slime semantics from dense [R, V] log-softmaxes: log p(target) − logsumexp over the
    nucleus and the target; tokens past the offsets unmasked."""
    out = []
    for logp, tokens, response, ids, offsets in zip(logps, data["tokens"], data["response_lengths"],
                                                     data["rollout_top_p_token_ids"],
                                                     data["rollout_top_p_token_offsets"]):
        targets = tokens[-response:]
        values = logp.gather(-1, targets[:, None])[:, 0].clone()
        for r in range(len(offsets) - 1):
            kept = set(ids[int(offsets[r]): int(offsets[r + 1])].tolist()) | {int(targets[r])}
            values[r] = values[r] - torch.logsumexp(logp[r, sorted(kept)], 0)
        out.append(values)
    return out


def _forward_and_step(kit, fused: bool):
    from slime.backends.megatron_utils import loss as slime_loss
    from slime.backends.megatron_utils import model as slime_model

    from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

    if fused:
        megatron_rl_patches.apply(only=FUSED)
    try:
        with kit.slime_session(rollout_temperature=TEMPERATURE, rollout_top_p=TOP_P, use_rollout_entropy=True,
                               entropy_coef=0.01, log_probs_chunk_size=4) as args:
            model, optimizer, scheduler = kit.build(args)
            data = nuclei(kit.rollout(0), 5)
            gpt = model[0]
            while hasattr(gpt, "module"):
                gpt = gpt.module
            student = kit.float64_copy(args, [p.detach() for p in gpt.parameters()])
            with VocabWideTensors(vocab=kit.VOCAB) as watch:
                out = slime_model.forward_only(slime_loss.get_log_probs_and_entropy, args, model,
                                               kit.iterators(data), [len(data["micro_batch_indices"])],
                                               use_rollout_top_p_replay=True)
            with torch.no_grad():
                logps = kit.response_logps(student, data, TEMPERATURE)
            step_data = nuclei(kit.rollout(0, [lp + 0.05 for lp in out["log_probs"]]), 5)
            for chunk in model:
                chunk.train()
            losses, grad_norm = slime_model.train_one_step(args, 0, 0, kit.iterators(step_data), model, optimizer,
                                                           scheduler, 2, 4)
            weights = [p.detach().clone() for p in model[0].parameters()]
    finally:
        megatron_rl_patches.revert()
    return out, logps, data, losses, grad_norm, weights, watch


@pytest.mark.layout("thd")
def test_top_p_replay_fused_matches_slime_and_float64(slime_cpu, caplog):
    kit = _kit()
    plain, logps, data, plain_losses, plain_norm, plain_weights, plain_watch = _forward_and_step(kit, fused=False)
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        fused, _, _, fused_losses, fused_norm, fused_weights, fused_watch = _forward_and_step(kit, fused=True)
    assert not [r for r in caplog.records if r.getMessage().startswith("slime_fused:")]  # no fallback
    want_lp = renormalized(logps, data)
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
