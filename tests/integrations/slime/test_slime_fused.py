"""`slime_fused`'s mechanics without slime's source: the fallback decisions and their one log line,
the combined-1F1B and multimodal fallbacks, and what slime's loss code reads off a fused output
(the lane, tests/integrations/slime/lane, runs slime's real code)."""
from __future__ import annotations

import logging
import types

import pytest
import torch

from megatron_rl_patches._log import forget_warnings
from megatron_rl_patches.integrations.megatron.model_chunk import mtp_heads_build_logits
from megatron_rl_patches.integrations.megatron.opd.opd_teachers import STEP_REQUEST
from megatron_rl_patches.integrations.slime import fused as slime_fused


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    forget_warnings()  # each fallback says its line again


def _args(**values):
    base = dict(rollout_top_p=1.0, enable_mtp_training=False, loss_type="policy_loss")
    return types.SimpleNamespace(**{**base, **values})


@pytest.mark.parametrize("values, feature", [
    ({"loss_type": "value_loss"}, "critic's value head"),
])
def test_unservable_names_the_feature(values, feature):
    assert feature in slime_fused.unservable(_args(**values))
    assert slime_fused.unservable(_args()) is None


def test_mtp_training_is_served():
    """slime's MTP training goes through the fused route (its heads through the fused head)."""
    assert slime_fused.unservable(_args(enable_mtp_training=True)) is None


def test_routing_replay_and_top_p_replay_are_served(monkeypatch):
    """issue 40: no fallback for routing replay (slime's window is around the fused call) nor for
    top-p replay at context-parallel size 1, zigzag and --allgather-cp (the lane compares each with
    slime's own path)."""
    monkeypatch.setenv("ENABLE_ROUTING_REPLAY", "1")
    monkeypatch.setenv("ROUTING_REPLAY_STAGE", "replay_forward")
    assert slime_fused.unservable(_args()) is None
    for cp in (1, 2):
        for allgather_cp in (False, True):
            assert slime_fused.unservable(_args(rollout_top_p=0.9, context_parallel_size=cp,
                                                allgather_cp=allgather_cp)) is None


def test_schedule_plan_goes_to_the_real_model_with_one_log_line(caplog):
    seen = []
    plan = slime_fused.FusedStep(_args(), True, False)
    step = slime_fused.fused_forward_step(lambda it, model, **kw: seen.append(model), plan)
    real = object()
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        step(None, real, return_schedule_plan=True)
        step(None, real, return_schedule_plan=True)
        step(None, real)
    assert seen[0] is real and seen[1] is real and isinstance(seen[2], slime_fused.FusedModel)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "combined-1F1B" in lines[0] and "no output_processor keyword" in lines[0]


class _PlanModel:
    """A last-stage chunk whose build_schedule_plan takes the processor (megatron-core >= 0.18's keywords)."""

    post_process = True

    def __init__(self):
        self.plans = []

    def build_schedule_plan(self, input_ids, position_ids, attention_mask, labels=None, packed_seq_params=None,
                            loss_mask=None, *, output_processor=None, output_processor_context=None):
        self.plans.append(dict(labels=labels, output_processor=output_processor, context=output_processor_context))
        return "plan"


def test_schedule_plan_with_a_processor_keyword_gets_the_fused_model(caplog, monkeypatch):
    from megatron_rl_patches.integrations.slime import rows

    monkeypatch.setattr(rows, "shifted_targets", lambda batch, n, device, ag: torch.arange(n))
    monkeypatch.setattr(rows, "response_rows", lambda batch, n, device, ag: torch.ones(n, dtype=torch.bool))
    plan = slime_fused.FusedStep(_args(allgather_cp=False), True, False, batch={"tokens": None})
    inner = _PlanModel()

    def forward_step(data_iterator, model, return_schedule_plan=False):
        return model.build_schedule_plan(input_ids=torch.zeros(1, 3, dtype=torch.long), position_ids=None,
                                         attention_mask=None, labels=None,
                                         packed_seq_params=types.SimpleNamespace(qkv_format="thd"))

    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        assert slime_fused.fused_forward_step(forward_step, plan)(None, inner, return_schedule_plan=True) == "plan"
    assert not [r for r in caplog.records if "slime_fused:" in r.getMessage()]
    (built,) = inner.plans
    assert torch.equal(built["labels"], torch.arange(3)[None]) and built["context"]["row_mask"].all()
    assert callable(built["output_processor"])


def test_mtp_kwargs_reach_the_model_with_the_processor(caplog, monkeypatch):
    """slime's `mtp_kwargs={"mtp_labels": tokens}` passes through to the processor call."""
    from megatron_rl_patches.integrations.slime import rows

    monkeypatch.setattr(rows, "shifted_targets", lambda batch, n, device, ag: torch.arange(n))
    monkeypatch.setattr(rows, "response_rows", lambda batch, n, device, ag: torch.ones(n, dtype=torch.bool))
    calls = []

    class MtpModel:
        def forward(self, input_ids, labels=None, packed_seq_params=None, mtp_kwargs=None, output_processor=None,
                    output_processor_context=None):
            calls.append(dict(mtp_kwargs=mtp_kwargs, output_processor=output_processor))
            return {"log_probs": torch.zeros(1, 3), "entropy": None}

        __call__ = forward

    args = _args(allgather_cp=False, enable_mtp_training=True)
    plan = slime_fused.FusedStep(args, True, False, batch={"tokens": None})
    tokens = torch.zeros(1, 3, dtype=torch.long)
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        out = slime_fused.FusedModel(MtpModel(), plan)(input_ids=tokens, mtp_kwargs={"mtp_labels": tokens},
                                                       packed_seq_params=types.SimpleNamespace(qkv_format="thd"))
    assert isinstance(out, slime_fused.FusedOutput)
    assert not [r for r in caplog.records if "slime_fused:" in r.getMessage()]
    assert calls[0]["mtp_kwargs"]["mtp_labels"] is tokens and calls[0]["output_processor"] is not None


def test_multimodal_batch_calls_the_model_unchanged(caplog):
    calls = []
    plan = slime_fused.FusedStep(_args(), True, False, batch={"multimodal_train_inputs": {"pixel_values": 1}})
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
    plan = slime_fused.FusedStep(_args(allgather_cp=False), True, False, batch={"tokens": None})
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
    plan = slime_fused.FusedStep(_args(allgather_cp=True), True, False, batch={"tokens": None})
    inner = _ProcessorModel()
    model = slime_fused.FusedModel(inner, plan)
    with pytest.raises(ValueError, match="--allgather-cp needs packed thd"):
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), packed_seq_params=packed)
    assert inner.calls == []


def test_a_fallen_back_train_step_still_fetches_a_top_k_losss_batch_keys(monkeypatch, caplog):
    """slime's logits path for the step (one log line), the OPD keys fetched, the model's logits
    carrying the step's invariant mode (the setting here: unset, False) to slime's log-prob code."""
    from megatron_rl_patches.integrations.megatron.opd.topk_request import TopkRequest
    from megatron_rl_patches.integrations.mode_logits import mode_of
    from megatron_rl_patches.integrations.slime.fused_step import fused_step_in

    monkeypatch.delenv("MEGATRON_RL_PATCHES_INVARIANT", raising=False)
    request = TopkRequest(ids_key="opd_ids", keys=("opd_ids",))
    monkeypatch.setattr(slime_fused, "step_request", lambda args, settings: request)
    seen = {}

    def schedule(*, forward_step_func, data_iterator):
        return forward_step_func

    def forward_step(data_iterator, model):
        return model(input_ids=None)

    def get_batch(data_iterator, keys):
        return {"keys": list(keys)}

    def train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer):
        seen["schedule"] = slime_fused.schedule_wrapper(lambda: schedule, None, (), {})(
            forward_step_func=forward_step, data_iterator=data_iterator)
        seen["batch"] = slime_fused.get_batch_wrapper(get_batch, None, (data_iterator[0], ["tokens"]), {})
        seen["plan"] = fused_step_in(seen["batch"])
        seen["batch"].pop("megatron_rl_patches_fused_step", None)

    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        slime_fused.train_one_step_wrapper(train_one_step, None, (_args(loss_type="value_loss"), 0, 0, [object()],
                                                                  None, None), {})
    logits = seen["schedule"](None, lambda **_: torch.zeros(1, 3, 5))  # slime's step on the last stage's chunk
    assert mode_of(logits) is False and logits.shape == (1, 3, 5)
    assert seen["batch"] == {"keys": ["tokens", "opd_ids"]}
    assert not seen["plan"].fused and seen["plan"].topk is request
    assert "critic's value head" in caplog.records[0].getMessage()
    monkeypatch.setattr(slime_fused, "step_request", lambda args, settings: None)
    slime_fused.train_one_step_wrapper(train_one_step, None, (_args(loss_type="value_loss"), 0, 0, [object()], None,
                                                              None), {})
    assert seen["batch"] == {"keys": ["tokens"]} and seen["plan"] is None


def test_the_plan_travels_with_the_data_iterators_not_the_calling_context(monkeypatch):
    """The step's plan reaches `get_batch`, the schedule and the loss's batch through the data
    iterators slime passes on, also where slime's forward steps run in another thread (no context
    variable follows there), and with every virtual stage's iterator; top-k OPD's settings are
    parsed once for the step, not per micro-batch. Before: a plan in a ContextVar, the settings
    parsed again by the loss of every micro-batch."""
    import threading

    from megatron_rl_patches.integrations.slime import fused_step
    from megatron_rl_patches.integrations.slime.fused_step import fused_step_in

    parsed = []
    monkeypatch.setattr(fused_step, "opd_settings", lambda: parsed.append(1) or "settings")
    monkeypatch.setattr(slime_fused, "step_request", lambda args, settings: STEP_REQUEST)
    seen: dict = {"batches": []}

    def get_batch(data_iterator, keys):
        return {"keys": list(keys), "from": data_iterator.get_next(keys)}

    def schedule(*, forward_step_func, data_iterator, model):
        for chunk, iterator in zip(model, data_iterator):  # one micro-batch per virtual stage, elsewhere
            worker = threading.Thread(target=forward_step_func, args=(iterator, chunk))
            worker.start()
            worker.join()

    def forward_step(data_iterator, model):
        seen["model"] = model
        seen["batches"].append(slime_fused.get_batch_wrapper(get_batch, None, (data_iterator, ["tokens"]), {}))

    def train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer):
        slime_fused.schedule_wrapper(lambda: schedule, None, (), {})(
            forward_step_func=forward_step, data_iterator=data_iterator, model=model)

    iterators = [types.SimpleNamespace(get_next=lambda keys, n=n: n) for n in range(2)]
    slime_fused.train_one_step_wrapper(train_one_step, None, (_args(), 0, 0, iterators, ["chunk0", "chunk1"], None),
                                       {})
    assert [batch["from"] for batch in seen["batches"]] == [0, 1]
    plans = [fused_step_in(batch) for batch in seen["batches"]]
    assert plans[0] is plans[1] and plans[0].topk is STEP_REQUEST and plans[0].settings == "settings"
    assert all(batch["keys"] == ["tokens", *STEP_REQUEST.keys] for batch in seen["batches"])
    assert isinstance(seen["model"], slime_fused.FusedModel) and parsed == [1]


def test_the_actor_steps_settings_reach_its_training_steps_parsed_once(monkeypatch):
    """Issue 73 item 5, issue 107: top-k OPD's settings are read once at slime's door, per slime
    `args` (`fused_step.slime_settings`, held by it): every `train_one_step` of the actor's
    `train_actor` reads the same (None: top-k OPD off, not parsed again either); slime's metrics
    never see them; another `args` reads its own. Before: parsed again by each train_one_step."""
    from megatron_rl_patches.integrations.megatron.step_iterators import carried
    from megatron_rl_patches.integrations.slime import fused_step, opd

    parsed: list = []
    monkeypatch.setattr(fused_step, "opd_settings", lambda: parsed.append("parsed"))  # top-k OPD off: None
    plans: list = []

    def train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer):
        plans.append(carried(data_iterator))

    args = _args()

    def train_actor(rollout_id, rollout_data):  # slime's: its data iterators over the rollout data, its steps
        iterators = [types.SimpleNamespace(rollout_data=rollout_data)]
        for step in range(2):
            slime_fused.train_one_step_wrapper(train_one_step, None, (args, rollout_id, step, iterators, None,
                                                                      None), {})

    rollout_data: dict = {"tokens": []}
    opd.train_actor_wrapper(train_actor, types.SimpleNamespace(args=args), (0, rollout_data), {})
    assert parsed == ["parsed"] and rollout_data == {"tokens": []}
    assert all(plan is not None and plan.settings is None for plan in plans) and len(plans) == 2
    logged: list = []
    opd.log_rollout_data_wrapper(lambda rollout_id, args, rollout_data: logged.append(rollout_data), None,
                                 (0, None, rollout_data), {})
    assert logged == [{"tokens": []}]
    slime_fused.train_one_step_wrapper(train_one_step, None, (_args(), 0, 0, [types.SimpleNamespace()], None, None),
                                       {})
    assert parsed == ["parsed", "parsed"]  # another args namespace: read at its own door


def test_an_iterator_carrying_a_step_is_slimes_iterator_and_copies():
    """Every attribute but the plan is the wrapped iterator's; a copy keeps both (no recursion
    through the wrapped one while the copy is built)."""
    import copy

    from megatron_rl_patches.integrations.megatron.step_iterators import carried, carrying

    plan = slime_fused.FusedStep(_args(), True, False)
    inner = types.SimpleNamespace(offset=3, micro_batch_indices=[[0], [1]])
    (wrapped,) = carrying([inner], plan)
    assert wrapped.offset == 3 and wrapped.micro_batch_indices == [[0], [1]] and carried([wrapped]) is plan
    assert carried(copy.copy(wrapped)) is plan and copy.copy(wrapped).offset == 3
    assert carried([inner]) is None and carrying([inner], None) == [inner]


@pytest.mark.megatron
@pytest.mark.parametrize("topk", [False, True], ids=["log-probs", "top-k OPD (ids live on the last stage)"])
def test_a_non_last_pipeline_stage_gets_the_plain_model_call(megatron_cpu, clean_patch_state, monkeypatch, topk):
    """issue 40: at PP=2 stage 0's chunk (a real GPTModel, post_process=False) returned its hidden
    states wrapped in FusedOutput ("dictionary update sequence element #0 has length 1"), and a
    top-k step asked stage 0 for ids only the last stage holds. The chunk gets the plain call."""
    from megatron.core.packed_seq_params import PackedSeqParams

    import megatron_rl_patches
    from megatron_rl_patches.integrations.slime import rows

    megatron_rl_patches.apply(only="gpt_output_processor")  # as slime's lane runs megatron-core 0.16
    length = 8
    # slime's row helpers, which a non-last stage must not need (the lane runs slime's own)
    monkeypatch.setattr(rows, "shifted_targets", lambda batch, n, device, ag: torch.zeros(n, dtype=torch.long))
    monkeypatch.setattr(rows, "response_rows", lambda batch, n, device, ag: torch.ones(n, dtype=torch.bool))
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    torch.manual_seed(3)  # stage 0 of a 2-stage pipeline: no output layer, thd input as slime packs it
    stage0 = GPTModel(config=megatron_cpu.config(), transformer_layer_spec=packed_gpt_spec(), vocab_size=64,
                      max_sequence_length=length, position_embedding_type="rope", post_process=False)
    request = STEP_REQUEST if topk else None
    plan = slime_fused.FusedStep(_args(allgather_cp=False), True, False, request, batch={"tokens": None})
    cu = torch.tensor([0, length], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=length,
                             max_seqlen_kv=length)
    tokens = torch.randint(0, 64, (1, length))
    call = dict(input_ids=tokens, position_ids=torch.arange(length)[None], attention_mask=None)
    out = slime_fused.FusedModel(stage0, plan)(**call, packed_seq_params=packed)
    assert isinstance(out, torch.Tensor) and not isinstance(out, dict)
    torch.testing.assert_close(out, stage0(**call, packed_seq_params=packed), rtol=0, atol=0)


@pytest.mark.megatron
def test_mtp_heads_building_logits_are_named_until_mtp_output_processor_is_applied(megatron_cpu, clean_patch_state):
    """A real GPTModel with one MTP head: from megatron-core 0.18 on its heads' loss is
    `process_mtp_loss` on [T, V] logits unless patch `mtp_output_processor` is applied; before 0.18
    the GPT backport serves the inline heads."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    import megatron_rl_patches

    config = megatron_cpu.config(mtp_num_layers=1)
    spec = get_gpt_layer_local_spec()
    model = gpt_model.GPTModel(config=config, transformer_layer_spec=spec, vocab_size=100, max_sequence_length=16,
                               mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
    native = hasattr(gpt_model, "process_mtp_loss")
    assert mtp_heads_build_logits(model) is native
    megatron_rl_patches.apply(only=["mtp_output_processor"])
    assert mtp_heads_build_logits(model) is False
    plain = gpt_model.GPTModel(config=megatron_cpu.config(), transformer_layer_spec=spec, vocab_size=100,
                               max_sequence_length=16)
    assert mtp_heads_build_logits(plain) is False
