"""MTP training on `slime_fused` with slime's own MTP semantics (slime's Megatron patch applied to the
lane's megatron-core, slime_megatron_patch.py): slime's `forward_only` and `train_one_step` with
`--enable-mtp-training` on a packed tiny GPT with one MTP head, the fused route against slime's
patched logits path — log-probs, entropy, slime's losses, the MTP loss megatron logs and every
parameter's reduced gradient (MTP head and output layer included) — and the [T, V] watch (slime's
logits path is its control). Negative control: a fused MTP head that does not take slime's
detached output weight gives the output layer a gradient slime's path does not have."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.testing import layouts

pytestmark = [pytest.mark.slime, layouts.mark("mtp")]

import megatron_rl_patches  # noqa: E402

FUSED = ["slime_fused", "gpt_output_processor", "mtp_output_processor"]
TEMPERATURE = 0.7
TILE_ROWS = 4  # slime's --log-probs-chunk-size for the main head, the fused MTP head's tile rows
VOCAB = 100  # unlike every other width of the tiny model (the MTP head's eh_proj is [h, 2h] = [32, 64])
MTP_ARGS = ("--mtp-num-layers", "1", "--enable-mtp-training", "--vocab-size", str(VOCAB))


def _named_grads(model: list) -> dict[str, torch.Tensor]:
    gpt = model[0]
    while hasattr(gpt, "module"):
        gpt = gpt.module
    return {name: p.main_grad.clone() for name, p in gpt.named_parameters()}


def _mtp_step(monkeypatch, patches: list[str]) -> dict:
    """slime's forward_only, then one train_one_step from the same fresh weights, with MTP training on."""
    import slime_kit as kit
    import slime_megatron_patch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from slime.backends.megatron_utils import model as slime_model

    from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

    assert slime_megatron_patch.active(), "GPTModel.forward lacks slime's mtp_kwargs: re-run tools/slime-lane"
    if patches:
        megatron_rl_patches.apply(only=patches)
    try:
        with kit.slime_session(*MTP_ARGS, rollout_temperature=TEMPERATURE, use_rollout_entropy=True,
                               entropy_coef=0.01, log_probs_chunk_size=TILE_ROWS) as args:
            model, optimizer, scheduler = kit.build(args)
            data = kit.rollout(0, vocab=VOCAB)
            grads: dict[str, torch.Tensor] = {}
            step = optimizer.step

            def step_noting_grads(*a, **k):  # the reduced gradients, before the optimizer consumes them
                grads.update(_named_grads(model))
                return step(*a, **k)

            monkeypatch.setattr(optimizer, "step", step_noting_grads)
            MTPLossLoggingHelper.tracker = {}
            with VocabWideTensors(vocab=VOCAB) as watch:
                out = kit.log_probs(args, model, data)
                for chunk in model:
                    chunk.train()
                step_data = kit.rollout(0, [lp + 0.05 for lp in out["log_probs"]], vocab=VOCAB)
                losses, _ = slime_model.train_one_step(args, 0, 0, kit.iterators(step_data), model, optimizer,
                                                       scheduler, 2, 4)
            mtp_loss = MTPLossLoggingHelper.tracker["values"].clone()
            MTPLossLoggingHelper.tracker = {}
    finally:
        megatron_rl_patches.revert()
    packed = max(sum(data["total_lengths"][i] for i in batch) for batch in data["micro_batch_indices"])
    return dict(out=out, losses=losses, mtp_loss=mtp_loss, grads=grads, watch=watch, packed=packed)


def _largest(want: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(want, got, strict=True))


def _undetached_weight(monkeypatch) -> None:
    """The negative control's fault: the fused MTP head projects with the output layer's live weight
    instead of the detached weight slime's patched forward hands it."""
    from megatron_rl_patches.processors import mtp_loss

    init = mtp_loss.FusedHeadLogits.__init__

    def live_weight(self, hidden_states, output_layer, weight, config):
        init(self, hidden_states, output_layer, output_layer.weight, config)

    monkeypatch.setattr(mtp_loss.FusedHeadLogits, "__init__", live_weight)


def test_fused_mtp_training_equals_slimes_patched_logits_path(slime_cpu, monkeypatch):
    from megatron_rl_patches.ops.kernels import torch_tiles

    plain = _mtp_step(monkeypatch, [])
    monkeypatch.setattr(torch_tiles, "MAX_TILE_ROWS", TILE_ROWS)  # the MTP head's tiles (no chunk size of its own)
    fused = _mtp_step(monkeypatch, FUSED)

    for key in ("log_probs", "entropy"):
        for a, b in zip(plain["out"][key], fused["out"][key], strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
    assert set(fused["losses"]) == set(plain["losses"])
    for key in plain["losses"]:
        torch.testing.assert_close(torch.as_tensor(fused["losses"][key]), torch.as_tensor(plain["losses"][key]),
                                   rtol=1e-5, atol=2e-6)
    assert plain["mtp_loss"].numel() == 1 and plain["mtp_loss"].item() > 0
    torch.testing.assert_close(fused["mtp_loss"], plain["mtp_loss"], rtol=1e-6, atol=1e-7)
    assert fused["grads"].keys() == plain["grads"].keys()
    print(f"MTP lane: max |Δlog-prob| {_largest(plain['out']['log_probs'], fused['out']['log_probs']):.1e}, "
          f"|Δmtp loss| {(fused['mtp_loss'] - plain['mtp_loss']).abs().max().item():.1e}, max |Δgrad| "
          f"{_largest(list(plain['grads'].values()), [fused['grads'][k] for k in plain['grads']]):.1e}")
    for name, want in plain["grads"].items():
        torch.testing.assert_close(fused["grads"][name], want, rtol=1e-5, atol=1e-7, msg=name)
    assert any(name.startswith("mtp.") and g.abs().sum() > 0 for name, g in fused["grads"].items())
    # the [T, V] watch: only row tiles on the fused route; slime's path builds [1, T, V] logits
    assert plain["watch"].largest_shape[-2] >= plain["packed"], plain["watch"].as_dict()
    assert fused["watch"].largest_shape == (TILE_ROWS, VOCAB), fused["watch"].as_dict()

    _undetached_weight(monkeypatch)
    wrong = _mtp_step(monkeypatch, FUSED)
    assert not torch.allclose(wrong["grads"]["output_layer.weight"], plain["grads"]["output_layer.weight"],
                              rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(wrong["mtp_loss"], plain["mtp_loss"], rtol=1e-6, atol=1e-7)
