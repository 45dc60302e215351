"""`slime_fused` and slime's combined-1F1B schedule plan (`model.build_schedule_plan`) on a real
GPTModel: where megatron-core's `build_schedule_plan` takes `output_processor` (>= 0.18) slime's
forward step gets the fused model and the plan carries the processor into its post-process node;
before 0.18 the step goes to slime's logits path with the line saying why. On CPU the plan is built
and its pre-process and post-process nodes run (`forward_impl`, around the real decoder): the same
log-probs and gradients as the fused model call, no [T, V] tensor (the plain plan's logits are the
watch's control). The full plan's schedule (expert-parallel overlap, alltoall dispatcher, CUDA
streams) runs in `make test-gpu` (test_slime_fused_schedule_plan_gpu.py)."""
from __future__ import annotations

import inspect
import logging
import types

import pytest
import torch

from megatron_rl_patches._log import forget_warnings
from megatron_rl_patches.integrations.slime import fused as slime_fused

pytestmark = pytest.mark.megatron
LENGTHS = (5, 7)
V = 100  # unlike every width of the tiny model
TILE_ROWS = 4


def _plan_takes_processor() -> bool:
    from megatron.core.models.gpt.gpt_model import GPTModel

    build = getattr(GPTModel, "build_schedule_plan", None)
    return build is not None and "output_processor" in inspect.signature(build).parameters


@pytest.fixture
def slime_rows(monkeypatch):
    """slime's row helpers (the lane runs slime's own): the packed batch's next-token labels, every
    row a response row."""
    from megatron_rl_patches.integrations.slime import rows

    def shifted_targets(batch, n, device, allgather_cp):
        return batch["labels"][0]

    monkeypatch.setattr(rows, "shifted_targets", shifted_targets)
    monkeypatch.setattr(rows, "response_rows", lambda batch, n, device, ag: torch.ones(n, dtype=torch.bool))


def _model_and_batch(env):
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt, make_packed_batch

    model = build_packed_gpt(vocab_size=V, seq_length=32, seed=4)
    batch = make_packed_batch(list(LENGTHS), vocab_size=V, seed=5)
    return model, batch


def _plan(batch: dict) -> slime_fused.FusedStep:
    args = types.SimpleNamespace(rollout_temperature=0.8, log_probs_chunk_size=TILE_ROWS, allgather_cp=False)
    return slime_fused.FusedStep(args, True, False, batch=batch)


def _call(batch: dict) -> dict:
    """slime's forward-step keywords (model.build_schedule_plan / model(...))."""
    return dict(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
                packed_seq_params=batch["packed_seq_params"], loss_mask=None)


def test_forward_step_routes_the_plan_by_build_schedule_plans_signature(megatron_cpu, caplog, monkeypatch):
    forget_warnings()  # each fallback says its line again
    model, batch = _model_and_batch(megatron_cpu)
    seen = []
    step = slime_fused.fused_forward_step(lambda it, model, **kw: seen.append(model), _plan(batch))
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        step(None, model, return_schedule_plan=True)
        step(None, model, return_schedule_plan=True)
    lines = [r.getMessage() for r in caplog.records if "slime_fused:" in r.getMessage()]
    if _plan_takes_processor():
        assert all(isinstance(m, slime_fused.FusedModel) for m in seen) and lines == []
    else:
        assert seen == [model, model]
        assert len(lines) == 1 and "combined-1F1B" in lines[0] and "megatron-core >= 0.18" in lines[0], lines


def _run_plan(model, plan) -> object:
    """The plan's pre-process node, the real decoder, the plan's post-process node (on CPU: no streams)."""
    state = plan._model_chunk_state
    hidden = plan.pre_process.forward_impl()
    hidden = model.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=state.rotary_pos_emb,
                           packed_seq_params=state.packed_seq_params)
    return plan.post_process.forward_impl(hidden)


def test_plan_carries_the_processor_to_its_post_process_node(megatron_cpu, clean_patch_state, slime_rows,
                                                             monkeypatch):
    if not _plan_takes_processor():
        pytest.skip("megatron-core < 0.18: build_schedule_plan has no output_processor (slime_fused falls back)")
    from megatron_rl_patches.ops.kernels import torch_tiles
    from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

    monkeypatch.setattr(torch_tiles, "MAX_TILE_ROWS", TILE_ROWS)
    model, batch = _model_and_batch(megatron_cpu)
    fused = slime_fused.FusedModel(model, _plan(batch))

    want = fused(**_call(batch))
    want["log_probs"].sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    with VocabWideTensors(V) as watch:
        plan = fused.build_schedule_plan(**_call(batch))
        got = _run_plan(model, plan)
        got["log_probs"].sum().backward()
    assert isinstance(got, slime_fused.FusedOutput) and got["log_probs"].shape == (1, sum(LENGTHS))
    torch.testing.assert_close(got["log_probs"], want["log_probs"], rtol=0, atol=0)
    torch.testing.assert_close(got["entropy"], want["entropy"], rtol=0, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], rtol=0, atol=0, msg=name)
    assert watch.largest_shape == (TILE_ROWS, V), watch.as_dict()
    # float64: log p(label) of the packed rows from the real model's logits
    with torch.no_grad():
        logits = model(**{**_call(batch), "labels": None})[0].double() / 0.8
    reference = torch.log_softmax(logits, -1).gather(-1, batch["labels"][0, :, None])[:, 0]
    torch.testing.assert_close(got["log_probs"][0].double(), reference, rtol=0, atol=2e-6)

    model.zero_grad()  # the control: the plain plan's post-process node builds the [T, V] logits
    with VocabWideTensors(V) as control:
        logits = _run_plan(model, model.build_schedule_plan(**_call(batch)))
    assert isinstance(logits, torch.Tensor) and logits.shape == (1, sum(LENGTHS), V)
    assert control.largest_shape[-2] >= sum(LENGTHS), control.as_dict()
