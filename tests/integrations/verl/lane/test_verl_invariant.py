"""verl's fused route (`verl_fused_logprobs`, verl 0.9.1's real engine forward_step) in the
invariant mode: four samples as one packed micro-batch or each alone give every token the same
log-prob and entropy bits, the switch read off the model config's `batch_invariant_mode`
(megatron-core's TransformerConfig attribute, set on the config object: a model cannot be built
with it on CPU) as verl's forward hands that config to the output processor; the negative
control, the same on every CPU: the invariant code runs in that mode only (counted; the default
mode's values usually move with the packing, but whether they do is the CPU's BLAS's choice).
The layers' output projections are zeroed so the hidden states are a function of the token alone
(the layers' own invariance is megatron-core's batch_invariant_mode on a GPU:
docs/train-rollout-agreement.md)."""
from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = pytest.mark.verl

import verl.models.mcore.registry  # noqa: E402,F401  (bound by name before any patch: see verl_kit)
import verl_kit as kit  # noqa: E402
from kit.zeroed_gpt import zeroed_output_gpt  # noqa: E402

import megatron_rl_patches  # noqa: E402
from megatron_rl_patches.testing.invariance import counting_invariant_calls  # noqa: E402

LENGTHS = (150, 97, 211, 64)
H, V = 128, 5000


def _model():
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    model = zeroed_output_gpt(V, sum(LENGTHS), hidden_size=H)
    patch_fused_forward(model)  # what verl's engine does at build time
    return model


def _micro_batch(ids: list[torch.Tensor]):
    from verl.utils import tensordict_utils as tu

    return tu.get_tensordict(
        {"input_ids": kit.nested(ids), "loss_mask": kit.nested([torch.ones(t.numel()) for t in ids]),
         "temperature": torch.full((len(ids),), 0.7)},
        {"calculate_entropy": True},
    )


def _values(model, ids, together: bool) -> dict[str, torch.Tensor]:
    """Every sample's log-probs and entropies (last position dropped: verl's filler label), the
    samples in one micro-batch or one each."""
    groups = [ids] if together else [[t] for t in ids]
    out: dict[str, list[torch.Tensor]] = {"log_probs": [], "entropy": []}
    with torch.no_grad():
        for group in groups:
            result = kit.forward_step(kit.engine(True), model, _micro_batch(group))
            for key in out:
                out[key] += [row[:-1] for row in kit.rows(result[key])]
    return {key: torch.cat(values) for key, values in out.items()}


def _apply() -> None:
    from megatron.core.models.gpt.gpt_model import GPTModel

    native = "output_processor" in inspect.signature(GPTModel.forward).parameters
    megatron_rl_patches.apply(only=["verl_fused_logprobs"] + ([] if native else ["gpt_output_processor"]))


def test_packed_and_alone_give_the_same_bits_with_batch_invariant_mode(verl_cpu):
    _apply()
    model = _model()
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, V, (n,), generator=g) for n in LENGTHS]
    seen, calls = {}, {}
    for mode in (True, False):
        model.config.batch_invariant_mode = mode  # what megatron-core's config carries on a GPU
        with counting_invariant_calls() as calls[mode]:
            seen[mode] = {together: _values(model, ids, together) for together in (True, False)}
    for key in ("log_probs", "entropy"):
        packed, alone = seen[True][True][key], seen[True][False][key]
        assert packed.numel() == sum(LENGTHS) - len(LENGTHS) and torch.isfinite(packed).all()
        assert torch.equal(packed, alone), (key, float((packed - alone).abs().max()))
    # the negative control, on every CPU: the invariant code ran in that mode only (the default
    # mode's bits usually move with the packing, but whether they do is the CPU's BLAS's choice)
    assert calls[True].count > 0 and calls[False].count == 0, calls
    torch.testing.assert_close(seen[False][True]["log_probs"], seen[True][True]["log_probs"], rtol=0, atol=1e-4)
