"""`slime_fused`'s mechanics without slime's source: the fallback decisions and their one log line,
the combined-1F1B and multimodal fallbacks, and what slime's loss code reads off a fused output
(the lane, tests/integrations/slime_lane, runs slime's real code)."""
from __future__ import annotations

import logging
import types

import pytest
import torch

from megatron_rl_patches.integrations import slime_fused


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(slime_fused, "_SAID", set())


def _args(**values):
    base = dict(rollout_top_p=1.0, enable_mtp_training=False, loss_type="policy_loss")
    return types.SimpleNamespace(**{**base, **values})


@pytest.mark.parametrize("values, feature", [
    ({"rollout_top_p": 0.9}, "top-p replay"),
    ({"enable_mtp_training": True}, "MTP training"),
    ({"loss_type": "value_loss"}, "critic's value head"),
])
def test_unservable_names_the_feature(values, feature):
    assert feature in slime_fused.unservable(_args(**values))
    assert slime_fused.unservable(_args()) is None


def test_routing_replay_is_unservable(monkeypatch):
    monkeypatch.setenv("ENABLE_ROUTING_REPLAY", "1")
    assert "routing replay" in slime_fused.unservable(_args())


def test_schedule_plan_goes_to_the_real_model_with_one_log_line(caplog):
    seen = []
    step = slime_fused.fused_step(lambda it, model, **kw: seen.append(model), slime_fused.Plan(_args(), True, False))
    real = object()
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        step(None, real, return_schedule_plan=True)
        step(None, real, return_schedule_plan=True)
        step(None, real)
    assert seen[0] is real and seen[1] is real and isinstance(seen[2], slime_fused.FusedModel)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "combined-1F1B" in lines[0]


def test_multimodal_batch_calls_the_model_unchanged(caplog):
    calls = []
    plan = slime_fused.Plan(_args(), True, False, batch={"multimodal_train_inputs": {"pixel_values": 1}})
    model = slime_fused.FusedModel(lambda **kw: calls.append(kw) or "logits", plan)
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        assert model(input_ids=torch.zeros(1, 3, dtype=torch.long), labels=None) == "logits"
    assert calls == [{"input_ids": calls[0]["input_ids"], "labels": None}]
    assert "multimodal inputs" in caplog.records[0].getMessage()


def test_fused_output_answers_what_slimes_loss_reads():
    log_probs = torch.randn(1, 5, requires_grad=True)
    out = slime_fused.FusedOutput({"log_probs": log_probs, "entropy": None})
    assert out.device == log_probs.device and out.dtype == torch.float32
    (0 * out.sum()).backward()
    assert log_probs.grad is not None and torch.equal(log_probs.grad, torch.zeros(1, 5))


def test_logits_go_to_slimes_own_function():
    def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                                  with_entropy=False):
        return "slime's"

    assert slime_fused.log_probs_wrapper(get_log_probs_and_entropy, None, (torch.zeros(1, 2, 3),),
                                         dict(args=None, unconcat_tokens=[], total_lengths=[],
                                              response_lengths=[])) == "slime's"


def _bshd_params():
    return types.SimpleNamespace(qkv_format="bshd")


class _ProcessorModel:
    """A model chunk whose forward takes the output processor (GPTModel's keywords); calls noted."""

    def __init__(self):
        self.calls = []

    def forward(self, input_ids, labels=None, packed_seq_params=None, output_processor=None,
                output_processor_context=None):
        self.calls.append(dict(input_ids=input_ids, packed_seq_params=packed_seq_params, labels=labels,
                               output_processor=output_processor))
        return "logits"

    __call__ = forward


@pytest.mark.parametrize("packed", [_bshd_params(), None], ids=["qkv_format=bshd", "no packed_seq_params"])
def test_bshd_batch_calls_the_model_unchanged_with_one_log_line(caplog, packed):
    inner = _ProcessorModel()
    plan = slime_fused.Plan(_args(allgather_cp=False), True, False, batch={"tokens": None})
    model = slime_fused.FusedModel(inner, plan)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        assert model(input_ids=tokens, packed_seq_params=packed) == "logits"
        assert model(input_ids=tokens, packed_seq_params=packed) == "logits"
    unchanged = dict(input_ids=tokens, packed_seq_params=packed, labels=None, output_processor=None)
    assert inner.calls == [unchanged] * 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "bshd" in lines[0] and "slime's own logits path" in lines[0], lines


@pytest.mark.parametrize("packed", [_bshd_params(), None], ids=["qkv_format=bshd", "no packed_seq_params"])
def test_allgather_cp_with_a_bshd_batch_is_a_clear_error(packed):
    plan = slime_fused.Plan(_args(allgather_cp=True), True, False, batch={"tokens": None})
    inner = _ProcessorModel()
    model = slime_fused.FusedModel(inner, plan)
    with pytest.raises(ValueError, match="--allgather-cp needs packed thd"):
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), packed_seq_params=packed)
    assert inner.calls == []


def test_a_fallen_back_train_step_still_fetches_a_top_k_losss_batch_keys(monkeypatch, caplog):
    """slime's logits path for the step (one log line), the schedule untouched, the OPD keys fetched."""
    from megatron_rl_patches.integrations import slime_opd

    request = slime_fused.TopkRequest(ids_key="opd_ids", keys=("opd_ids",))
    monkeypatch.setattr(slime_opd, "step_request", lambda args: request)
    schedule, seen = object(), {}

    def get_batch(data_iterator, keys):
        return {"keys": list(keys)}

    def train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer):
        seen["schedule"] = slime_fused.schedule_wrapper(lambda: schedule, None, (), {})
        seen["batch"] = slime_fused.get_batch_wrapper(get_batch, None, (None, ["tokens"]), {})

    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        slime_fused.train_one_step_wrapper(train_one_step, None, (_args(rollout_top_p=0.9), 0, 0, None, None, None), {})
    assert seen["schedule"] is schedule and seen["batch"] == {"keys": ["tokens", "opd_ids"]}
    assert "top-p replay" in caplog.records[0].getMessage()
    monkeypatch.setattr(slime_opd, "step_request", lambda args: None)
    slime_fused.train_one_step_wrapper(train_one_step, None, (_args(rollout_top_p=0.9), 0, 0, None, None, None), {})
    assert seen["batch"] == {"keys": ["tokens"]}
