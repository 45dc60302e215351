"""verl's live self-teacher (`integrations.verl.self_teacher`) in one process, beside its verl lane
(`lane/test_verl_self_teacher.py`: verl 0.9.1's real engine step and loss, 2 ranks): here a dict
stands in for verl's micro-batch, a one-function module for `verl.utils.tensordict_utils`, and a
GPTModel in little (embedding, output layer) for the student. The rows against the float64
log-softmax of the student's logits, laid out as verl's agent loop lays them; the old-log-prob
pass's rows read back by the update; every refusal matched whole (issue 86 item 17)."""
from __future__ import annotations

import functools
import re
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from megatron_rl_patches.apps.bench.allocated import AllocatedPeak
from megatron_rl_patches.integrations.verl import self_teacher
from megatron_rl_patches.integrations.verl.old_rows import old_rows_of
from megatron_rl_patches.ops.scoring_plan import ScoringPlan
from megatron_rl_patches.teachers.batch import TeacherBatch

pytest.importorskip("megatron.core", reason="check_layout reads megatron-core's parallel state")

WHO = "verl's live self-teacher (MEGATRON_RL_PATCHES_VERL_TEACHER='student;context=KEY')"
KEY, K, VOCAB, PADDED = "hint", 3, 11, 16
PROMPTS, RESPONSES = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]]
CONTEXTS = [[2, 9], [5]]


def whole(text: str) -> str:
    return "^" + re.escape(text) + "$"


def nested(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


class Core(torch.nn.Module):
    """A GPTModel in little: each position's logits its own token's embedding through the output
    layer (causal by construction), the padded vocabulary's rows included; each call's positions
    and attention mask noted."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(PADDED, 5)
        self.output_layer = torch.nn.Linear(5, PADDED, bias=False)
        self.vocab_size, self.pre_process, self.post_process = PADDED, True, True
        self.config = SimpleNamespace(sequence_parallel=False)
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, ids, positions, mask, output_processor=None):
        self.calls.append((ids, positions, mask))
        hidden = self.embedding(ids)
        if output_processor is not None:  # megatron-core's hook: [s, b, H] in place of the output layer
            return output_processor(hidden_states=hidden.transpose(0, 1), output_layer=self.output_layer,
                                    config=self.config)
        return self.output_layer(hidden)


class Wrapped(torch.nn.Module):
    """verl's wrappers around the model chunk (DDP, Float16Module: `.module`)."""

    def __init__(self, core: Core) -> None:
        super().__init__()
        self.module = core

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@pytest.fixture(autouse=True)
def tensordict_utils(monkeypatch):
    """verl's `tensordict_utils.get_non_tensor_data` (a key's value, else the default) on a dict."""
    verl, utils, tu = (types.ModuleType(name) for name in ("verl", "verl.utils", "verl.utils.tensordict_utils"))
    tu.get_non_tensor_data = lambda data, key, default: data.get(key, default)
    verl.utils, utils.tensordict_utils = utils, tu
    for module in (verl, utils, tu):
        monkeypatch.setitem(sys.modules, module.__name__, module)


def instance(use_fused_kernels: bool = False) -> SimpleNamespace:
    return SimpleNamespace(engine_config=SimpleNamespace(use_fused_kernels=use_fused_kernels),
                           model_config=SimpleNamespace(hf_config=SimpleNamespace(vocab_size=VOCAB)))


def micro_batch(placeholder: bool = True, contexts=CONTEXTS) -> dict:
    """verl's distillation micro-batch: packed ids, a loss mask as long as each sequence marking its
    response, the contexts under KEY, the agent loop's placeholder rows K wide."""
    sequences = [torch.tensor(p + r) for p, r in zip(PROMPTS, RESPONSES)]
    batch = {"input_ids": nested(sequences),
             "loss_mask": nested([torch.tensor([0] * len(p) + [1] * len(r)) for p, r in zip(PROMPTS, RESPONSES)])}
    if contexts is not None:
        batch[KEY] = [c if isinstance(c, str) else list(c) for c in contexts]
    if placeholder:
        batch["teacher_ids"] = nested([torch.zeros(len(s), K, dtype=torch.int32) for s in sequences])
        batch["teacher_logprobs"] = nested([torch.zeros(len(s), K) for s in sequences])
    return batch


def float64_rows(core: Core) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample, the top-K of the float64 log-softmax over the real vocabulary at each response
    row of context + response (row r predicts token r + 1)."""
    out = []
    for context, response in zip(CONTEXTS, RESPONSES):
        sequence = torch.tensor(context + response)
        with torch.no_grad():
            logits = core.output_layer.weight.double() @ core.embedding.weight.double()[sequence].T
        rows = logits.T[len(context) - 1:len(sequence) - 1, :VOCAB].log_softmax(-1)
        values, ids = rows.topk(K, dim=-1)
        out.append((ids, values))
    return out


def loss_function(k: int | None = K):
    config = SimpleNamespace(distillation_loss=SimpleNamespace(topk=k))
    return functools.partial(lambda **call: None, config=None, distillation_config=config)


def test_k_from_the_placeholder_rows_else_the_losss_config_else_refused_whole():
    assert self_teacher.topk_width(micro_batch(), None) == K
    assert self_teacher.topk_width({"teacher_ids": torch.zeros(2, 5, 4)}, None) == 4
    assert self_teacher.topk_width({"teacher_ids": torch.zeros(5)}, loss_function(7)) == 7
    assert self_teacher.topk_width({}, loss_function(2)) == 2
    refusal = whole(f"{WHO}: the micro-batch has no teacher_ids to take K from and the loss names no "
                    "distillation_config.distillation_loss.topk: configure verl's top-k distillation "
                    "(use_topk, topk=K)")
    for loss in (None, loss_function(None), loss_function(0), functools.partial(print)):
        with pytest.raises(ValueError, match=refusal):
            self_teacher.topk_width({}, loss)


def test_the_fused_route_pipeline_and_context_parallelism_refused_whole():
    core = Core()
    self_teacher.check_layout(core, micro_batch(), instance())
    fused = whole(f"{WHO}: verl's fused route (use_fused_kernels) has no logits processor for the top-k loss to read "
                  "the teacher's rows in; run the live self-teacher with use_fused_kernels=False")
    with pytest.raises(ValueError, match=fused):
        self_teacher.check_layout(core, micro_batch(), instance(use_fused_kernels=True))
    with pytest.raises(ValueError, match=fused):
        self_teacher.check_layout(core, {**micro_batch(), "use_fused_kernels": True}, instance())
    self_teacher.check_layout(core, {**micro_batch(), "use_fused_kernels": False},
                              instance(use_fused_kernels=True))
    pipeline = whole(f"{WHO}: pipeline parallelism is not hosted (the no-grad pass runs one whole model chunk); run "
                     "the live self-teacher at pipeline-parallel size 1, or serve a copy of the student")
    for stage in ("pre_process", "post_process"):
        staged = Core()
        setattr(staged, stage, False)
        with pytest.raises(ValueError, match=pipeline):
            self_teacher.check_layout(staged, micro_batch(), instance())
    with pytest.raises(ValueError, match=whole(f"{WHO}: context parallelism is not hosted (the no-grad pass runs "
                                               "whole sequences); run it without context parallelism")):
        self_teacher.check_layout(core, {**micro_batch(), "local_cp_size": 2}, instance())


def test_the_students_real_vocabulary_is_its_hf_configs_within_the_output_layers():
    core = Core()
    assert self_teacher.student_vocab(instance(), core) == VOCAB
    for real in (None, 0, PADDED + 1, 12.0):
        host = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(vocab_size=real)))
        assert self_teacher.student_vocab(host, core) == PADDED
    assert self_teacher.student_vocab(SimpleNamespace(), core) == PADDED
    host = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(vocab_size=PADDED)))
    assert self_teacher.student_vocab(host, core) == PADDED


def test_the_teachers_batch_is_each_context_then_its_response_and_a_missing_field_refused_whole():
    privileged = self_teacher.self_batch(micro_batch(), KEY, None, VOCAB)
    assert [s.tolist() for s in privileged.sequences] == [c + r for c, r in zip(CONTEXTS, RESPONSES)]
    assert privileged.response_starts == [2, 1]
    with pytest.raises(ValueError, match=whole(
            f"{WHO}: the micro-batch has no non-tensor field 'hint' (context='hint'; its non-tensor fields are "
            "['other']): put each sample's privileged context in that field of verl's batch")):
        self_teacher.self_batch({**micro_batch(contexts=None), "other": [1, 2]}, KEY, None, VOCAB)
    with pytest.raises(ValueError, match=whole(f"{WHO}: sample 0's context under 'hint' holds id 11, past the "
                                               "teacher's vocabulary of 11: tokenize it with the teacher's tokenizer")):
        self_teacher.self_batch(micro_batch(contexts=[[11], [1]]), KEY, None, VOCAB)


def test_each_sequence_runs_alone_causal_and_padded_to_the_sequence_parallel_width():
    core = Core()
    batch = TeacherBatch([torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7])], [2, 1])
    given = self_teacher.student_pass(Wrapped(core), 4)(batch)
    (ids, positions, mask), (ids2, _, mask2) = core.calls
    assert ids.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]] and ids2.tolist() == [[6, 7, 0, 0]]
    assert positions.tolist() == [list(range(8))]
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 8, 8)
    assert torch.equal(mask[0, 0], torch.ones(8, 8, dtype=torch.bool).triu(1)) and mask2.shape == (1, 1, 4, 4)
    hidden = core.embedding.weight[torch.tensor([1, 2, 3, 4, 5])].detach()  # the final hidden states: no logits
    assert [tuple(r.shape) for r in given.hidden] == [(3, 5), (1, 5)] and torch.equal(given.hidden[0], hidden[1:4])
    assert given.output_weight is core.output_layer.weight
    self_teacher.student_pass(Wrapped(core), 1)(batch)
    assert core.calls[2][0].shape == (1, 5)


def test_rows_laid_out_as_verls_agent_loop_lays_them():
    rows = [(torch.tensor([[4, 5], [6, 7]]), torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], dtype=torch.float64)),
            (torch.tensor([[8, 9]]), torch.tensor([[-0.5, -0.25]], dtype=torch.float64))]
    ids, log_probs = self_teacher.verl_teacher_rows(rows, [5, 3], [3, 2], 2)
    assert ids.layout == log_probs.layout == torch.jagged  # verl reads their offsets()
    assert ids.dtype == torch.int32 and log_probs.dtype == torch.float32
    assert [t.tolist() for t in ids.unbind()] == [[[0, 0], [0, 0], [4, 5], [6, 7], [0, 0]], [[0, 0], [8, 9], [0, 0]]]
    assert [t.tolist() for t in log_probs.unbind()] == [
        [[0, 0], [0, 0], [-1, -2], [-3, -4], [0, 0]], [[0, 0], [-0.5, -0.25], [0, 0]]]


def test_the_update_is_taught_by_the_students_float64_rows_in_a_copy_of_verls_batch():
    core = Core()
    batch = micro_batch()
    before = {name: value for name, value in batch.items()}
    marked = self_teacher.self_taught(batch, Wrapped(core), instance(), loss_function(), (KEY, None))
    assert batch == before and batch["teacher_ids"] is before["teacher_ids"]  # verl's batch untouched
    assert len(core.calls) == 2 and core.training  # one pass per sample, the chunk's mode restored
    for (ids, values), got_ids, got_values, prompt in zip(float64_rows(core), marked["teacher_ids"].unbind(),
                                                           marked["teacher_logprobs"].unbind(), PROMPTS):
        n = ids.shape[0]
        assert got_ids.dtype == torch.int32 and got_values.dtype == torch.float32
        assert torch.equal(got_ids[len(prompt) - 1:len(prompt) - 1 + n].long(), ids)
        torch.testing.assert_close(got_values[len(prompt) - 1:len(prompt) - 1 + n].double(), values,
                                   rtol=0, atol=1e-5)
        assert not got_ids[:len(prompt) - 1].any() and not got_values[len(prompt) - 1 + n:].any()


def test_the_old_log_prob_passs_rows_teach_the_update_after_the_weights_change():
    core, host = Core(), instance()
    old = float64_rows(core)
    self_teacher.remember_old_rows(micro_batch(), Wrapped(core), host, (KEY, None))
    assert len(old_rows_of(host).rows) == 2
    with torch.no_grad():
        core.output_layer.weight.mul_(-2.0)  # the update's optimizer step
    calls = len(core.calls)
    marked = self_teacher.self_taught(micro_batch(), Wrapped(core), host, loss_function(), (KEY, None))
    assert len(core.calls) == calls  # read back: no pass of its own
    for (ids, values), got_ids, got_values, prompt in zip(old, marked["teacher_ids"].unbind(),
                                                           marked["teacher_logprobs"].unbind(), PROMPTS):
        rows = slice(len(prompt) - 1, len(prompt) - 1 + ids.shape[0])
        assert torch.equal(got_ids[rows].long(), ids)
        torch.testing.assert_close(got_values[rows].double(), values, rtol=0, atol=1e-5)
    fresh = self_teacher.self_taught(micro_batch(contexts=[[3], [4]]), Wrapped(core), host, loss_function(),
                                     (KEY, None))
    assert len(core.calls) == calls + 2  # rows nobody kept: scored now
    assert fresh["teacher_ids"].values().any()


def test_a_micro_batch_without_placeholder_rows_or_its_field_is_left_to_the_update():
    core, host = Core(), instance()
    self_teacher.remember_old_rows(micro_batch(placeholder=False), Wrapped(core), host, (KEY, None))
    self_teacher.remember_old_rows(micro_batch(contexts=None), Wrapped(core), host, (KEY, None))
    assert core.calls == [] and old_rows_of(host).rows == {}
    with pytest.raises(ValueError, match=whole(f"{WHO}: sample 0's context under 'hint' holds id 11, past the "
                                                    "teacher's vocabulary of 11: tokenize it with the teacher's "
                                                    "tokenizer")):
        self_teacher.remember_old_rows(micro_batch(contexts=[[11], [1]]), Wrapped(core), host, (KEY, None))
    assert core.calls == []


def test_text_contexts_read_in_the_named_tokenizer_and_its_ids_checked_against_its_vocabulary(tmp_path):
    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path, 10)  # "tN" is id N; a vocabulary of 10, within the student's 11
    core = Core()
    texts = micro_batch(contexts=["t2 t9", "t5"])
    privileged = self_teacher.self_batch(texts, KEY, str(tmp_path), VOCAB)
    assert [s.tolist() for s in privileged.sequences] == [c + r for c, r in zip(CONTEXTS, RESPONSES)]
    with pytest.raises(ValueError, match=whole(f"{WHO}: sample 1's context under 'hint' holds id 10, past the "
                                               "teacher's vocabulary of 10: tokenize it with the teacher's tokenizer")):
        self_teacher.self_batch(micro_batch(contexts=[[1], [10]]), KEY, str(tmp_path), VOCAB)
    marked = self_teacher.self_taught(texts, Wrapped(core), instance(), loss_function(), (KEY, str(tmp_path)))
    for (ids, _), got_ids, prompt in zip(float64_rows(core), marked["teacher_ids"].unbind(), PROMPTS):
        assert torch.equal(got_ids[len(prompt) - 1:len(prompt) - 1 + ids.shape[0]].long(), ids)


def test_a_core_without_stage_flags_is_one_whole_chunk_and_context_parallelism_refused(monkeypatch):
    from megatron.core import parallel_state

    self_teacher.check_layout(SimpleNamespace(), micro_batch(), instance())  # no pre/post_process: not staged
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)  # a CP = 2 world's answer
    with pytest.raises(ValueError, match=whole(f"{WHO}: context parallelism is not hosted (the no-grad pass runs "
                                               "whole sequences); run it without context parallelism")):
        self_teacher.check_layout(Core(), micro_batch(), instance())


def test_the_pass_never_holds_the_privileged_sequences_logits():
    """At a shape where the logits dominate (V = 8192, H = 5, 600 response rows: [R, V] float32 is
    19 MiB, the output weight 0.16 MiB), the pass and its scoring hold no [R, V] tensor: the fused
    head's vocabulary tiles (4 MiB on CPU) are the largest. The old pass (the model's logits of
    every privileged sequence) held [L, V] > [R, V]."""
    wide, rows = 8192, 600
    core = Core()
    core.embedding = torch.nn.Embedding(wide, 5)
    core.output_layer = torch.nn.Linear(5, wide, bias=False)
    core.vocab_size = wide
    gen = torch.Generator().manual_seed(1)
    privileged = TeacherBatch([torch.randint(0, wide, (rows + 3,), generator=gen)], [3])
    with AllocatedPeak() as seen:
        scored = self_teacher.scored_rows(Wrapped(core), core, None, wide, ScoringPlan(K), KEY, privileged)
    (ids, values), = scored
    assert ids.shape == (rows, K) and values.shape == (rows, K)
    assert seen.largest < rows * wide * 4 // 2, (seen.largest, rows * wide * 4)  # bytes: float32 [R, V] is 4 R V
    expected = (core.embedding.weight[privileged.sequences[0][2:-1]].double()
                @ core.output_layer.weight.double().T).log_softmax(-1)
    assert torch.equal(ids, expected.topk(K, dim=-1).indices)
    torch.testing.assert_close(values, expected.gather(1, ids), rtol=0, atol=1e-5)
