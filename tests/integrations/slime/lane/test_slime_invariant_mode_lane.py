"""Issue 73 item 5 on slime 624b824a's real `forward_only` and `train_one_step`: the student's
invariant mode (its model config's `batch_invariant_mode`, the setting unset) reaches the log-prob
adapter on slime's logits path with the data (the logits slime hands its callbacks), through
slime's own `get_log_probs_and_entropy` (squeeze, temperature, contiguous). The config's True and
False both reach it (each the negative control of the other). Where no patched step marks the
logits (slime's train step without `slime_fused`), the adapter takes the setting."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slime

import megatron_rl_patches  # noqa: E402


def _spied_modes(monkeypatch) -> list:
    """The `invariant` each call of the log-prob op gets from the adapter."""
    from megatron_rl_patches.ops import logprobs

    seen: list = []
    original = logprobs.log_probs_and_entropy

    def spy(*args, **kwargs):
        seen.append(kwargs.get("invariant"))
        return original(*args, **kwargs)

    monkeypatch.setattr(logprobs, "log_probs_and_entropy", spy)
    return seen


def _set_mode(model, on: bool) -> None:
    from megatron.core.utils import get_model_config

    get_model_config(model[0]).batch_invariant_mode = on  # what megatron-core's config carries on a GPU


# slime_fused without gpt_output_processor on megatron-core 0.16: the model has no output_processor
# keyword, so every step falls back to slime's logits path (one log line)
@pytest.mark.parametrize("patches, train_follows", [(["slime_logprobs"], False),
                                                    (["slime_logprobs", "slime_fused"], True)])
def test_the_students_mode_reaches_the_adapter_on_slimes_logits_path(slime_cpu, monkeypatch, patches,
                                                                      train_follows):
    import slime_kit as kit
    from slime.backends.megatron_utils import model as slime_model

    monkeypatch.delenv("MEGATRON_RL_PATCHES_INVARIANT", raising=False)
    seen = _spied_modes(monkeypatch)
    megatron_rl_patches.apply(only=patches)
    with kit.slime_session(rollout_temperature=0.7) as args:
        model, optimizer, scheduler = kit.build(args)
        for on in (True, False):
            _set_mode(model, on)
            seen.clear()
            out = kit.log_probs(args, model, kit.rollout(0))
            assert seen and set(seen) == {on}, seen  # forward_only: the logits its callback gets carry it
            step_data = kit.rollout(0, [lp + 0.05 for lp in out["log_probs"]])
            for chunk in model:
                chunk.train()
            seen.clear()
            slime_model.train_one_step(args, 0, 0, kit.iterators(step_data), model, optimizer, scheduler, 2, 4)
            for chunk in model:
                chunk.eval()
            # without slime_fused no patched step hands the train step's logits over: None, the op's own
            # resolution (the setting; unset here, the default mode)
            assert seen and set(seen) == {on if train_follows else None}, seen
