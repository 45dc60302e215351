"""Patch `gpt_output_processor`: GPTModel.forward(output_processor=..., output_processor_context=...)
on megatron-core < 0.18 behaves as the native hook of 0.18+ (and is `native` there)."""
from __future__ import annotations

import inspect

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches.patching import registry

pytestmark = pytest.mark.megatron


def _native() -> bool:
    from megatron.core.models.gpt.gpt_model import GPTModel

    # unwrap: while `gpt_output_processor` is applied the wrapper reports the keywords too
    return "output_processor" in inspect.signature(inspect.unwrap(GPTModel.forward)).parameters


def _gpt(megatron_cpu, tied: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    return GPTModel(
        config=megatron_cpu.config(),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
        share_embeddings_and_output_weights=tied,
    )


def logits_processor(**received):
    """A processor that does what the output layer would: it must reproduce the model's logits."""
    layer, weight, hidden = received["output_layer"], received["output_weight"], received["hidden_states"]
    logits, _ = layer(hidden, weight=weight)
    return {"logits": logits.transpose(0, 1), "received": received}


def test_without_the_patch_old_megatron_rejects_the_keyword(megatron_cpu, clean_patch_state):
    if _native():
        pytest.skip("this megatron-core has output_processor natively")
    model = _gpt(megatron_cpu, tied=False)
    batch = megatron_cpu.batch()
    with pytest.raises(TypeError, match="output_processor"):
        model(batch["tokens"], batch["position_ids"], batch["attention_mask"], output_processor=logits_processor)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_processor_gets_the_output_layer_inputs(megatron_cpu, clean_patch_state, tied):
    statuses = megatron_rl_patches.apply(only="gpt_output_processor")
    if _native():
        assert {(s.status, s.code) for s in statuses} == {("skipped", registry.NATIVE)}
    else:
        assert {s.status for s in statuses} == {"applied"}
    model = _gpt(megatron_cpu, tied)
    batch = megatron_cpu.batch()
    expected = megatron_cpu.forward(model, batch)  # [b, s, V] through the output layer
    context = {"anything": 1}
    out = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
        output_processor=logits_processor, output_processor_context=context,
    )
    assert torch.equal(out["logits"], expected)
    received = out["received"]
    assert received["context"] is context and torch.equal(received["labels"], batch["labels"])
    assert received["hidden_states"].shape == (16, 2, 32)  # [s, b, h]
    assert received["output_layer"] is model.output_layer
    if tied:
        assert received["output_weight"] is model.shared_embedding_or_output_weight()
    else:
        assert received["output_weight"] is None
    assert received["config"] is model.config
    # The model is unchanged: a plain call still gives logits and the output layer has no stand-in.
    assert "forward" not in model.output_layer.__dict__
    assert torch.equal(megatron_cpu.forward(model, batch), expected)


def test_processor_errors_leave_the_model_usable(megatron_cpu, clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")
    model = _gpt(megatron_cpu, tied=False)
    batch = megatron_cpu.batch()

    def failing(**_):
        raise ZeroDivisionError("inside the processor")

    with pytest.raises(ZeroDivisionError):
        model(batch["tokens"], batch["position_ids"], batch["attention_mask"], output_processor=failing)
    assert "forward" not in model.output_layer.__dict__
    if not _native():
        with pytest.raises(TypeError, match="output_processor must be callable"):
            model(batch["tokens"], batch["position_ids"], batch["attention_mask"], output_processor="nope")
    assert megatron_cpu.forward(model, batch).shape == (2, 16, 64)


def test_revert_restores_the_original_forward(megatron_cpu, clean_patch_state):
    from megatron.core.models.gpt.gpt_model import GPTModel

    original = vars(GPTModel)["forward"]
    megatron_rl_patches.apply(only="gpt_output_processor")
    megatron_rl_patches.revert()
    assert vars(GPTModel)["forward"] is original


def test_signature_reports_the_backported_keywords_and_revert_restores_it(megatron_cpu, clean_patch_state):
    """Code that detects the hook by signature (verl 0.9.1's `_supports_output_processor_hook`,
    `inspect.signature(model.forward)`, which follows `__wrapped__`) sees it while applied."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    if _native():
        pytest.skip("this megatron-core has output_processor natively")
    original = inspect.signature(GPTModel.forward)
    megatron_rl_patches.apply(only="gpt_output_processor")
    model = _gpt(megatron_cpu, tied=False)
    captured = model.forward
    for forward in (GPTModel.forward, model.forward):
        assert {"output_processor", "output_processor_context"} <= set(inspect.signature(forward).parameters)
    assert "output_processor" not in inspect.signature(inspect.unwrap(GPTModel.forward)).parameters  # megatron's own
    megatron_rl_patches.revert()
    assert inspect.signature(GPTModel.forward) == original
    assert "output_processor" not in inspect.signature(captured).parameters  # a reference kept from before
