"""A processor on a model with MTP heads builds no [T, V] on every lane (megatron-core < 0.18: the
GPT backport serves the inline MTP heads through the fused head), and patch `mtp_output_processor`
on a real tiny GPTModel with two MTP depths (megatron-core >= 0.18):
the MTP heads' loss through the fused head equals megatron's own `process_mtp_loss` on logits —
the step's loss, every parameter's gradient and the logged MTP loss and acceptance counts — tied
and untied, with `mtp_detach_heads` and per-token loss; and a step with MTP and an output
processor builds no [T, V] tensor (the vocab watch; megatron's logits path is its negative control)."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import log_prob_output_processor
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

pytestmark = [pytest.mark.megatron, layouts.mark("mtp")]
V, B, S = 100, 2, 16  # V differs from every other width of the tiny model (2h = 64 is MTP's eh_proj input)
T = B * S
TILE_ROWS = 8


def test_processor_with_mtp_heads_equals_the_logits_route_without_vocab_wide_tensors(megatron_cpu,
                                                                                   clean_patch_state, monkeypatch):
    """Every lane: megatron's logits route (main head and MTP heads) against an output processor on
    the main head with the MTP heads through the fused head (the backport's inline route before
    0.18, `mtp_output_processor` from 0.18 on): the same gradients, and only row tiles of logits."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_rl_patches.ops.kernels import torch_tiles

    env = megatron_cpu
    MTPLossLoggingHelper.tracker = {}
    monkeypatch.setattr(torch_tiles, "MAX_TILE_ROWS", TILE_ROWS)
    model = _model(env)
    batch = _batch(env, seed=6)
    with VocabWideTensors(V) as logits_route:
        want_loss, want = _step(model, batch)
    assert logits_route.largest_bytes >= T * V * 4, logits_route.as_dict()  # the control: [T, V] logits
    want_logged = _tracked(MTPLossLoggingHelper)
    MTPLossLoggingHelper.tracker = {}

    megatron_rl_patches.apply(only=["gpt_output_processor", "mtp_output_processor"])
    with VocabWideTensors(V) as fused_route:
        got_loss, got = _step(model, batch, log_prob_output_processor(chunk_size=TILE_ROWS))
    assert fused_route.largest_shape == (TILE_ROWS, V), fused_route.as_dict()
    assert torch.allclose(got_loss, want_loss, rtol=1e-6)
    assert _same(got, want)
    assert any(name.startswith("mtp.") and g.abs().sum() > 0 for name, g in got.items())
    logged = _tracked(MTPLossLoggingHelper)
    assert logged.keys() == want_logged.keys() and all(torch.allclose(logged[k], want_logged[k], rtol=1e-6)
                                                       for k in logged)
    MTPLossLoggingHelper.tracker = {}


@pytest.fixture
def mtp_kit(megatron_cpu, clean_patch_state):
    multi_token_prediction = pytest.importorskip("megatron.core.transformer.multi_token_prediction")
    if not hasattr(multi_token_prediction, "process_mtp_loss"):
        pytest.skip("megatron-core < 0.18 computes the MTP loss inline (no process_mtp_loss)")
    helper = multi_token_prediction.MTPLossLoggingHelper
    helper.tracker = {}
    yield megatron_cpu, helper
    helper.tracker = {}


def _model(env, tied=False, seed=0, **config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = env.config(mtp_num_layers=2, mtp_loss_scaling_factor=0.3, **config)
    spec = get_gpt_layer_local_spec()
    torch.manual_seed(seed)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=V, max_sequence_length=S,
                    share_embeddings_and_output_weights=tied,
                    mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))


def _step(model, batch, processor=None):
    """One training step's backward: the main head's mean loss (the MTP losses ride on it through
    MTPLossAutoScaler); returns the loss and every gradient."""
    model.zero_grad(set_to_none=True)
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    if processor is None:
        loss = model(*args, labels=batch["labels"], loss_mask=batch["loss_mask"]).mean()
    else:
        loss = -model(*args, labels=batch["labels"], loss_mask=batch["loss_mask"],
                      output_processor=processor)["log_probs"].mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _batch(env, seed=3):
    batch = env.batch(B, S, V, seed=seed)
    batch["loss_mask"] = (torch.rand(B, S, generator=torch.Generator().manual_seed(seed)) < 0.8).float()
    return batch


def _same(got: dict, want: dict, rel: float = 2e-6) -> bool:
    return got.keys() == want.keys() and all(
        float((got[k] - want[k]).abs().max()) <= rel * float(want[k].abs().max().clamp_min(1.0)) for k in want)


def _tracked(helper) -> dict:
    return {k: v.clone() for k, v in helper.tracker.items() if isinstance(v, torch.Tensor)}


CASES = {
    "untied": dict(tied=False),
    "tied+detach_heads": dict(tied=True, mtp_detach_heads=True),
    "per_token_loss": dict(tied=False, calculate_per_token_loss=True),
}


def _needs_detach_heads(options: dict) -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "mtp_detach_heads" in options and "mtp_detach_heads" not in TransformerConfig.__dataclass_fields__:
        pytest.skip("this megatron-core has no mtp_detach_heads (added in 0.19)")


def _logged_keys() -> set[str]:
    """What megatron's MTP loss logging records: 0.19 adds the acceptance counts (0.18: "values")."""
    from megatron.core.transformer import multi_token_prediction

    if hasattr(multi_token_prediction, "_compute_mtp_acceptance_counts"):
        return {"loss_values", "correct_values", "total_values"}
    return {"values"}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_mtp_loss_equals_megatrons_logits_loss(mtp_kit, case):
    env, helper = mtp_kit
    options = dict(CASES[case])
    _needs_detach_heads(options)
    model = _model(env, options.pop("tied"), **options)
    batch = _batch(env)

    want_loss, want = _step(model, batch)
    want_logged = _tracked(helper)
    helper.tracker = {}
    statuses = megatron_rl_patches.apply(only="mtp_output_processor")
    states = {s.state for s in statuses if "hybrid" not in s.target}  # hybrid: not imported
    assert "applied" in states and states <= {"applied", "n/a"}, statuses  # n/a: 0.18's missing acceptance counts
    got_loss, got = _step(model, batch)

    assert torch.equal(got_loss, want_loss)  # the main head is untouched
    assert _same(got, want)
    assert any(name.startswith("mtp.") and g.abs().sum() > 0 for name, g in got.items())
    logged = _tracked(helper)
    assert logged.keys() == want_logged.keys() and _logged_keys() <= set(logged)
    assert all(torch.allclose(logged[k], want_logged[k], rtol=1e-6) for k in logged)

    # negative control: another MTP loss scale moves the gradients where the comparison looks
    model.config.mtp_loss_scaling_factor = 0.31
    _, scaled = _step(model, batch)
    assert not _same(scaled, want)


def test_detached_heads_leave_the_output_weight_to_the_main_head(mtp_kit):
    env, _ = mtp_kit
    _needs_detach_heads({"mtp_detach_heads": True})
    megatron_rl_patches.apply(only="mtp_output_processor")
    batch = _batch(env, seed=4)
    _, detached = _step(_model(env, mtp_detach_heads=True), batch)
    _, attached = _step(_model(env, mtp_detach_heads=False), batch)
    assert _same({k: v for k, v in detached.items() if k.startswith("mtp.")},
                 {k: v for k, v in attached.items() if k.startswith("mtp.")})
    assert not _same({"w": detached["output_layer.weight"]}, {"w": attached["output_layer.weight"]})


def test_a_step_with_mtp_builds_no_vocab_wide_tensor(mtp_kit, monkeypatch):
    from megatron_rl_patches.ops.kernels import torch_tiles

    env, _ = mtp_kit
    monkeypatch.setattr(torch_tiles, "MAX_TILE_ROWS", TILE_ROWS)  # the MTP heads' tiles: 8 of T = 32 rows
    model = _model(env)
    batch = _batch(env, seed=5)
    processor = log_prob_output_processor(chunk_size=TILE_ROWS)
    native_hook = "output_processor" in __import__("inspect").signature(model.forward).parameters
    if not native_hook:
        megatron_rl_patches.apply(only="gpt_output_processor")

    # negative control: the main head fused, megatron's MTP heads on logits: [T, V] per depth
    with VocabWideTensors(V) as logits_route:
        want_loss, want = _step(model, batch, processor)
    assert logits_route.largest_bytes >= T * V * 4, logits_route.as_dict()

    megatron_rl_patches.apply(only="mtp_output_processor")
    with VocabWideTensors(V) as fused_route:
        got_loss, got = _step(model, batch, processor)
    assert fused_route.largest_shape == (TILE_ROWS, V), fused_route.as_dict()  # row tiles only, forward and backward
    assert torch.allclose(got_loss, want_loss, rtol=1e-6) and _same(got, want)


def test_the_backport_refuses_mtp_without_the_fused_mtp_loss(mtp_kit):
    """A processor through a backported hook with MTP heads whose loss would call the output
    layer is refused before the forward (here: GPTModel's forward through the backport wrapper)."""
    from megatron_rl_patches.processors.backport_common import forward_with_processor

    env, _ = mtp_kit
    model = _model(env)
    batch = _batch(env)
    forward = type(model).forward.__get__(model)

    def call():
        return forward_with_processor(forward, model, (batch["tokens"], batch["position_ids"],
                                                       batch["attention_mask"]),
                                      {"labels": batch["labels"], "output_processor": log_prob_output_processor()})

    if "output_processor" not in __import__("inspect").signature(forward).parameters:
        with pytest.raises(ValueError, match="mtp_output_processor"):
            call()
    megatron_rl_patches.apply(only="mtp_output_processor")
    assert call()["log_probs"].shape == (B, S)
