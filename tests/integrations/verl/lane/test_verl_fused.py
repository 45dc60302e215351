"""`verl_fused_logprobs` on verl 0.9.1's real code: the engine's forward_step (fused and unfused
routes), fused_forward_model_engine and gptmodel_forward_model_engine, on a tiny packed GPTModel."""
from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = pytest.mark.verl

import verl.models.mcore.registry  # noqa: E402,F401  (bound by name before any patch: see verl_kit)
import verl_kit as kit  # noqa: E402

import megatron_rl_patches  # noqa: E402
from megatron_rl_patches.testing.packed_gpt import build_packed_gpt  # noqa: E402
from megatron_rl_patches.testing.vocab_watch import VocabWideTensors  # noqa: E402

TEMPERATURE = 0.7


def _native_hook() -> bool:
    from megatron.core.models.gpt.gpt_model import GPTModel

    return "output_processor" in inspect.signature(GPTModel.forward).parameters


def _model(**kwargs):
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    model = build_packed_gpt(vocab_size=kit.VOCAB, **kwargs)
    patch_fused_forward(model)  # what verl's engine does at build time (_maybe_enable_fused_kernels)
    return model


def _apply() -> None:
    names = ["verl_fused_logprobs"] + ([] if _native_hook() else ["gpt_output_processor"])
    megatron_rl_patches.apply(only=names)  # pending until verl's modules are imported, or applied

    statuses = megatron_rl_patches.applied()
    assert {s.status for s in statuses if s.name == "verl_fused_logprobs"} == {"applied"}


def test_unpatched_fused_route_needs_cuda(verl_cpu):
    if not _native_hook():
        pytest.skip("below megatron-core 0.18 verl patches the forward itself (same Triton kernel)")
    model = _model()
    with pytest.raises(Exception) as failure:
        kit.forward_step(kit.engine(True), model, kit.batch())
    assert not isinstance(failure.value, TypeError), failure.value  # it is the kernel, not the call


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_patched_fused_forward_step_matches_float64_and_verls_unfused_route(verl_cpu, tied):
    _apply()
    model = _model(share_embeddings=tied)
    micro_batch = kit.batch(temperature=TEMPERATURE)
    fused = kit.forward_step(kit.engine(True), model, micro_batch)
    unfused = kit.forward_step(kit.engine(False), model, kit.batch(temperature=TEMPERATURE))
    log_probs, entropies = kit.reference(model, micro_batch, TEMPERATURE)
    for got, plain, want in zip(kit.rows(fused["log_probs"]), kit.rows(unfused["log_probs"]), log_probs):
        assert (got[:-1].double() - want[:-1]).abs().max() < 1e-5
        assert torch.allclose(got, plain, atol=1e-5)
    for got, plain, want in zip(kit.rows(fused["entropy"]), kit.rows(unfused["entropy"]), entropies):
        assert (got[:-1].double() - want[:-1]).abs().max() < 1e-5
        assert torch.allclose(got, plain, atol=1e-5)


def _grads_of(model, output, entropy_coef):
    model.zero_grad(set_to_none=True)
    weights = [torch.linspace(-1, 1, n) for n in kit.LENGTHS]
    loss = sum((lp * w).sum() for lp, w in zip(kit.rows(output["log_probs"]), weights))
    if entropy_coef:
        loss = loss + entropy_coef * sum(e.sum() for e in kit.rows(output["entropy"]))
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("entropy_coef", [0.0, 0.3])
def test_patched_fused_gradients_match_verls_unfused_route(verl_cpu, entropy_coef):
    _apply()
    model = _model()
    asked = entropy_coef != 0.0
    fused = _grads_of(model, kit.forward_step(kit.engine(True), model, kit.batch(calculate_entropy=asked)),
                      entropy_coef)
    plain = _grads_of(model, kit.forward_step(kit.engine(False), model, kit.batch(calculate_entropy=asked)),
                      entropy_coef)
    assert fused.keys() == plain.keys() and len(fused) > 4
    for name in fused:
        assert torch.allclose(fused[name], plain[name], atol=2e-5, rtol=1e-4), name


def test_entropy_only_when_verl_asks(verl_cpu):
    from verl.models.mcore.model_forward_fused import fused_forward_model_engine

    _apply()
    model = _model()
    micro_batch = kit.batch()
    ids = micro_batch["input_ids"]
    seen = []
    model.output_layer.register_forward_pre_hook(lambda module, args: seen.append(True))
    out = fused_forward_model_engine(False)(model, ids, ids.clone(), {}, TEMPERATURE, False, 0)
    assert set(out) == {"log_probs"} and seen  # and the output layer's pre-hooks ran (param gather)
    out = fused_forward_model_engine(False)(model, ids, ids.clone(), {}, TEMPERATURE, True, 0)
    assert set(out) == {"log_probs", "entropy"} and out["entropy"].requires_grad


def test_no_vocabulary_wide_tensor_on_the_patched_fused_route(verl_cpu):
    _apply()
    vocab, lengths = 16384, (200, 120)  # CPU logits tiles are 8 MiB: [320, 6553] here, never [T, V]
    model = build_packed_gpt(vocab_size=vocab, seq_length=256)
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    patch_fused_forward(model)
    full = sum(lengths) * vocab * 4  # one [T, V] fp32 tensor
    with VocabWideTensors(vocab) as fused:
        out = kit.forward_step(kit.engine(True), model, kit.batch(lengths, vocab))
        (out["log_probs"].values().sum() + out["entropy"].values().sum()).backward()
    with VocabWideTensors(vocab) as plain:
        out = kit.forward_step(kit.engine(False), model, kit.batch(lengths, vocab))
        (out["log_probs"].values().sum() + out["entropy"].values().sum()).backward()
    assert plain.largest_bytes >= full
    assert fused.largest_bytes <= full // 2, fused.as_dict()


def test_revert_restores_verls_processor(verl_cpu):
    import verl.models.mcore.model_forward_fused as fused_module

    original = fused_module.fused_output_processor
    _apply()
    assert fused_module.fused_output_processor is not original
    megatron_rl_patches.revert()
    assert fused_module.fused_output_processor is original


def test_late_apply_after_verl_cached_its_mode(verl_cpu):
    """verl caches the fused mode when the engine builds the model; apply() after that still
    routes through the processor (below 0.18 the stale 'legacy' mode is dropped at the next call)."""
    model = _model()  # verl decides its mode now, before any patch
    cached = model._verl_fused_forward_mode
    assert cached == ("hook" if _native_hook() else "legacy")
    _apply()
    micro_batch = kit.batch(temperature=TEMPERATURE)
    out = kit.forward_step(kit.engine(True), model, micro_batch)
    assert model._verl_fused_forward_mode == "hook" and not hasattr(model, "forward_backup")
    log_probs, _ = kit.reference(model, micro_batch, TEMPERATURE)
    for got, want in zip(kit.rows(out["log_probs"]), log_probs):
        assert (got[:-1].double() - want[:-1]).abs().max() < 1e-5


def test_early_apply_verl_detects_the_hook(verl_cpu):
    _apply()
    model = _model()
    assert model._verl_fused_forward_mode == "hook" and not hasattr(model, "forward_backup")


def test_signature_below_018_and_after_revert(verl_cpu):
    from megatron.core.models.gpt.gpt_model import GPTModel

    if _native_hook():
        pytest.skip("megatron-core >= 0.18 has the keywords natively")
    original = inspect.signature(GPTModel.forward)
    _apply()
    model = build_packed_gpt(vocab_size=kit.VOCAB)
    assert {"output_processor", "output_processor_context"} <= set(inspect.signature(model.forward).parameters)
    assert GPTModel.forward.__wrapped__ is not None and not hasattr(GPTModel.forward.__wrapped__, "__signature__")
    megatron_rl_patches.revert()
    assert inspect.signature(GPTModel.forward) == original
