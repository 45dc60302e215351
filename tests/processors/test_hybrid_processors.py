"""Patch `hybrid_output_processor`: HybridModel.forward(output_processor=, output_processor_context=)
on megatron-core >= 0.18, and every output processor on a real tiny HybridModel against the model's
own logits path: log-probs and entropy, top-k buckets, the full-vocabulary divergence from a
HybridModel teacher — values and every parameter's gradient, tied and untied, each comparison
with a negative control that shows it sees a real difference."""
from __future__ import annotations

import inspect

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import (
    divergence_output_processor,
    hidden_output_processor,
    log_prob_output_processor,
    log_probs_and_entropy,
    topk_ids,
    topk_logprobs,
    topk_output_processor,
)
from megatron_rl_patches.patching import registry
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.compare import close, collect_grads
from megatron_rl_patches.testing.divergence_reference import dense_divergence

pytestmark = [pytest.mark.megatron, layouts.mark("hybrid")]
REL = 2e-6
V, B, S = 64, 2, 16


@pytest.fixture
def hybrid(megatron_cpu, clean_patch_state):
    """The kit with HybridModel, `hybrid_output_processor` applied (skipped before megatron-core 0.18)."""
    from megatron_rl_patches.testing.megatron_cpu import ModelKindUnavailable

    try:
        env = megatron_cpu.with_kind("hybrid")
    except ModelKindUnavailable as exc:
        pytest.skip(str(exc))
    statuses = megatron_rl_patches.apply(only="hybrid_output_processor")
    assert {s.state for s in statuses} <= {"applied", "native"}, statuses
    return env


def _model(env, tied: bool = False, seed: int = 0, layer_pattern: str = "*-*-"):
    from megatron_rl_patches.testing import tiny_hybrid

    torch.manual_seed(seed)
    return tiny_hybrid.build(env.config(num_layers=len(layer_pattern)), layer_pattern, vocab_size=V,
                             max_sequence_length=S, share_embeddings_and_output_weights=tied)


def _args(batch):
    return batch["tokens"], batch["position_ids"], batch["attention_mask"]






def _same_grads(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(close(got[name], want[name], REL) for name in want)


def test_without_the_patch_hybrid_model_rejects_the_keyword(megatron_cpu, clean_patch_state):
    from megatron_rl_patches.testing.megatron_cpu import ModelKindUnavailable

    try:
        env = megatron_cpu.with_kind("hybrid")
    except ModelKindUnavailable as exc:
        pytest.skip(str(exc))
    model = _model(env)
    if "output_processor" in inspect.signature(model.forward).parameters:
        pytest.skip("this megatron-core's HybridModel has output_processor natively")
    with pytest.raises(TypeError, match="output_processor"):
        model(*_args(env.batch()), output_processor=log_prob_output_processor())


def test_the_patch_reports_the_keywords_and_revert_restores_the_forward(hybrid):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    original = vars(HybridModel)["forward"].__wrapped__  # megatron's own, under the patch's wrapper
    status = megatron_rl_patches.applied()
    mine = [s for s in status if s.name == "hybrid_output_processor"]
    assert [s.status for s in mine] == ["applied"], mine  # no megatron-core release has the hook yet
    model = _model(hybrid)
    for forward in (HybridModel.forward, model.forward):
        assert {"output_processor", "output_processor_context"} <= set(inspect.signature(forward).parameters)
    megatron_rl_patches.revert()
    assert vars(HybridModel)["forward"] is original
    assert "output_processor" not in inspect.signature(model.forward).parameters


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_log_prob_processor_equals_the_logits_path(hybrid, tied):
    model = _model(hybrid, tied)
    batch = hybrid.batch(seed=3)
    a = torch.randn(B, S, generator=torch.Generator().manual_seed(1))
    b = 0.1 * torch.randn(B, S, generator=torch.Generator().manual_seed(2))

    def logits_route(temperature):
        logits = model(*_args(batch))  # [b, s, V] through the output layer
        lp, ent = log_probs_and_entropy(logits.reshape(-1, V), batch["labels"].reshape(-1), temperature=temperature,
                                        with_entropy=True)
        ((a.reshape(-1) * lp).sum() + (b.reshape(-1) * ent).sum()).backward()
        return lp.reshape(B, S).detach(), ent.reshape(B, S).detach(), collect_grads(model)

    lp_ref, ent_ref, want = logits_route(0.8)
    out = model(*_args(batch), labels=batch["labels"],
                output_processor=log_prob_output_processor(temperature=0.8, with_entropy=True))
    assert set(out) == {"log_probs", "entropy"}
    ((a * out["log_probs"]).sum() + (b * out["entropy"]).sum()).backward()
    got = collect_grads(model)
    assert close(out["log_probs"], lp_ref, REL) and close(out["entropy"], ent_ref, REL)
    assert _same_grads(got, want)
    assert ("output_layer.weight" in got) != tied and ("embedding.word_embeddings.weight" in got)
    # negative control: the logits route at a slightly different temperature is seen as different
    lp_off, _, grads_off = logits_route(0.81)
    assert not close(out["log_probs"], lp_off, REL) and not _same_grads(got, grads_off)


def test_topk_processor_for_a_student_and_a_teacher_scoring_its_ids(hybrid):
    student, teacher = _model(hybrid, seed=0), _model(hybrid, tied=True, seed=1)
    batch = hybrid.batch(seed=7)
    out = student(*_args(batch), output_processor=topk_output_processor(k=4, temperature=0.9))
    logits = student(*_args(batch))
    ids_ref = topk_ids(logits.detach() / 0.9, 4)
    assert torch.equal(out["topk_ids"], ids_ref)
    lp_ref, tail_ref = topk_logprobs(logits, ids_ref, temperature=0.9)
    assert close(out["topk_log_probs"], lp_ref.detach(), REL) and close(out["tail"], tail_ref.detach(), REL)
    (lp_ref.sum() + tail_ref.sum()).backward()
    want = collect_grads(student)
    (out["topk_log_probs"].sum() + out["tail"].sum()).backward()
    assert _same_grads(collect_grads(student), want)

    with torch.no_grad():
        scored = teacher(*_args(batch), output_processor=topk_output_processor(),
                         output_processor_context={"ids": out["topk_ids"]})
        t_lp, t_tail = topk_logprobs(teacher(*_args(batch)), out["topk_ids"])
    assert close(scored["topk_log_probs"], t_lp, REL) and close(scored["tail"], t_tail, REL)
    assert not close(scored["topk_log_probs"], lp_ref.detach(), REL)  # negative control: the student's differ


def test_divergence_from_a_hybrid_teacher_equals_the_dense_route(hybrid):
    student, teacher = _model(hybrid, seed=0), _model(hybrid, seed=1, layer_pattern="-*-*")
    batch = hybrid.batch(seed=9)
    options = dict(divergence="jsd", beta=0.4)

    with torch.no_grad():
        hidden = teacher(*_args(batch), output_processor=hidden_output_processor())
        teacher_logits = teacher(*_args(batch)).double().reshape(B * S, V)
    assert hidden.shape == (B, S, 32)
    out = student(*_args(batch), output_processor=divergence_output_processor(**options),
                  output_processor_context={"teacher_hidden": hidden, "teacher_weight": teacher.output_layer.weight})
    out.sum().backward()
    got = collect_grads(student)
    dense = dense_divergence(student(*_args(batch)).double().reshape(B * S, V), [teacher_logits], **options)
    dense.sum().backward()
    want = collect_grads(student)
    assert close(out.double(), dense.reshape(B, S).detach(), REL) and _same_grads(got, want)
    other = dense_divergence(student(*_args(batch)).double().reshape(B * S, V), [teacher_logits],
                             divergence="jsd", beta=0.5)
    assert not close(out.double(), other.reshape(B, S).detach(), REL)  # negative control: another beta


def test_processor_errors_leave_the_hybrid_model_usable(hybrid):
    model = _model(hybrid)
    batch = hybrid.batch()

    def failing(**_):
        raise ZeroDivisionError("inside the processor")

    with pytest.raises(ZeroDivisionError):
        model(*_args(batch), output_processor=failing)
    assert "forward" not in model.output_layer.__dict__
    with pytest.raises(TypeError, match="output_processor must be callable"):
        model(*_args(batch), output_processor="nope")
    with pytest.raises(ValueError, match="needs labels"):
        model(*_args(batch), output_processor=log_prob_output_processor())
    assert model(*_args(batch)).shape == (B, S, V)


class _NativeHook:
    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, *,
                output_processor=None, output_processor_context=None):
        return "native"


class _OtherCallSite:
    def forward(self, tokens, positions):
        return "other"


@pytest.mark.parametrize(("owner", "code"), [(_NativeHook, registry.NATIVE), (_OtherCallSite, registry.SIGNATURE)],
                         ids=["native", "other-call-site"])
def test_detected_by_signature_native_or_skipped_with_the_reason(monkeypatch, owner, code):
    """A HybridModel.forward that has the keywords itself is `native` (nothing wrapped); one whose
    call site differs is `skipped` with the reason; neither is changed."""
    import types

    from megatron_rl_patches.integrations.megatron.patches import PATCHES
    from megatron_rl_patches.patching.registry import Registry

    record = next(p for p in PATCHES if p.name == "hybrid_output_processor")
    module = types.ModuleType("hybrid_signature_probe")
    module.HybridModel = owner
    monkeypatch.setitem(__import__("sys").modules, "hybrid_signature_probe", module)
    from dataclasses import replace

    probe = Registry([replace(record, target="hybrid_signature_probe:HybridModel.forward", version_finder=None,
                              requires=None)])
    original = vars(owner)["forward"]
    (status,) = probe.apply(strict=False)
    assert status.status == "skipped" and status.code == code, status
    assert ("output_processor" in status.reason) if code == registry.NATIVE else ("expects" in status.reason)
    assert vars(owner)["forward"] is original


@layouts.mark("mtp")
def test_hybrid_model_with_mtp_heads_through_the_fused_head(hybrid, monkeypatch):
    """HybridModel with two MTP depths ("*-/*-/*-"): a processor needs `mtp_output_processor` (refused
    without it, before the forward), and with it the step equals megatron's logits route —
    gradients and logged MTP loss — building only row tiles of logits, never [T, V]."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_rl_patches.ops.kernels import torch_tiles
    from megatron_rl_patches.testing import tiny_hybrid
    from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

    vocab, rows, tile = 100, B * S, 8  # a vocabulary unlike every other width (MTP's eh_proj takes 2h = 64)
    monkeypatch.setattr(torch_tiles, "MAX_TILE_ROWS", tile)
    torch.manual_seed(0)
    model = tiny_hybrid.build(hybrid.config(num_layers=2, mtp_num_layers=2, mtp_loss_scaling_factor=0.3),
                              "*-/*-/*-", vocab_size=vocab, max_sequence_length=S)
    batch = hybrid.batch(B, S, vocab, seed=11)
    processor = log_prob_output_processor(chunk_size=tile)
    with pytest.raises(ValueError, match="mtp_output_processor"):
        model(*_args(batch), labels=batch["labels"], output_processor=processor)

    MTPLossLoggingHelper.tracker = {}
    with VocabWideTensors(vocab) as logits_route:
        model(*_args(batch), labels=batch["labels"]).mean().backward()
    assert logits_route.largest_bytes >= rows * vocab * 4  # the control: [T, V] logits
    key = "loss_values" if "loss_values" in MTPLossLoggingHelper.tracker else "values"  # 0.18: "values"
    want, want_logged = collect_grads(model), MTPLossLoggingHelper.tracker[key].clone()

    MTPLossLoggingHelper.tracker = {}
    megatron_rl_patches.apply(only=["hybrid_output_processor", "mtp_output_processor"])
    with VocabWideTensors(vocab) as fused_route:
        (-model(*_args(batch), labels=batch["labels"], output_processor=processor)["log_probs"].mean()).backward()
    assert fused_route.largest_shape == (tile, vocab), fused_route.as_dict()
    got = collect_grads(model)
    assert _same_grads(got, want) and any(name.startswith("mtp.") for name in got)
    assert torch.allclose(MTPLossLoggingHelper.tracker[key], want_logged, rtol=1e-6)
    MTPLossLoggingHelper.tracker = {}
