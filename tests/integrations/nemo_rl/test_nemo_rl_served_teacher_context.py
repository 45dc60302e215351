"""A privileged `ServedTeacherPolicy` (`served_teacher_policy(url, context=KEY)`): where NeMo-RL's
contexts come from (the batch field KEY, or the rollout batch's field / extra_env_info through
`served_teacher_in_setup`) and each refusal naming the sample and the key, before any request (the
URL answers nothing). Without NeMo-RL's source or a server; the rows against transformers' float64
run in the NeMo-RL lane (lane/test_nemo_rl_served_teacher.py)."""
from __future__ import annotations

import types

import pytest
import torch

from megatron_rl_patches.integrations.nemo_rl import served_teacher_in_setup, served_teacher_policy
from megatron_rl_patches.integrations.nemo_rl.rollout_contexts import batch_contexts

NOWHERE = "http://127.0.0.1:9"


def _data(**extra):
    data = {"input_ids": torch.tensor([[5, 6, 7, 8, 0], [1, 2, 3, 4, 9]]), "input_lengths": torch.tensor([4, 5]),
            "token_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])}
    data.update(extra)
    return data


@pytest.fixture
def tokenizer_dir(tmp_path):
    pytest.importorskip("tokenizers")
    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path, 50)
    return tmp_path


def test_the_teachers_batch_is_each_samples_context_then_its_response(tokenizer_dir):
    policy = served_teacher_policy(NOWHERE, top_k=4, context="hint", tokenizer=tokenizer_dir)
    batch = policy.privileged(*_rows(), _data(hint=[[40, 41], "t7 t8 t9"]), "hint")
    assert [s.tolist() for s in batch.sequences] == [[40, 41, 7, 8], [7, 8, 9, 2, 3, 4, 9]]
    assert batch.response_starts == [2, 3]


def _rows():
    from megatron_rl_patches.integrations.nemo_rl.teacher_rows import rows_of
    from megatron_rl_patches.teachers.batch import TeacherBatch

    ids, lengths, starts = rows_of(_data())
    return (TeacherBatch([ids[i, :int(lengths[i])] for i in range(2)], starts),)


@pytest.mark.parametrize("extra, error, message", [
    ({}, ValueError, r"context='hint' and neither this batch .* holds the field: run distillation_train inside"),
    ({"hint": [[1, 2]]}, ValueError, r"data\['hint'\] holds 1 contexts for a batch of 2 samples"),
    ({"hint": [[1, 2], None]}, ValueError, r"sample 1 has no context under 'hint'"),
    ({"hint": [[1, 2], "text"]}, ValueError, r"sample 1's context under 'hint' is text and no teacher tokenizer"),
    ({"hint": [[1, 2], []]}, ValueError, r"context 'hint'.*contexts\[1\] is empty"),
    ({"hint": torch.ones(2, 3, dtype=torch.long)}, TypeError, r"data\['hint'\] must hold one context per sample"),
])
def test_a_context_the_teacher_cannot_score_is_refused_by_name_before_any_request(extra, error, message):
    data = _data(**extra)
    before = {key: value.clone() for key, value in data.items() if isinstance(value, torch.Tensor)}
    with pytest.raises(error, match=message):
        served_teacher_policy(NOWHERE, top_k=4, context="hint").get_topk_logits(data, k=4)
    assert all(torch.equal(before[key], data[key]) for key in before)


def test_ids_past_the_teachers_vocabulary_are_refused(tokenizer_dir):
    policy = served_teacher_policy(NOWHERE, top_k=4, context="hint", tokenizer=tokenizer_dir)
    with pytest.raises(ValueError, match=r"sample 0's context under 'hint' holds id 50, past the teacher's vocabulary"):
        policy.get_topk_logits(_data(hint=[[50], [1]]), k=4)


def test_a_tokenizer_without_a_context_is_refused():
    with pytest.raises(ValueError, match=r"tokenizer=\.\.\.\) reads text contexts"):
        served_teacher_policy(NOWHERE, tokenizer="/ckpt")


def test_the_rollout_batchs_field_or_extra_env_info_reaches_the_teacher_in_setup():
    seen = []
    module = types.ModuleType("distillation")
    module.Policy = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    def rollout(policy_generation=None, input_batch=None):
        seen.append(input_batch)
        return input_batch, {}

    module.run_multi_turn_rollout = rollout  # type: ignore[attr-defined]
    policy = served_teacher_policy(NOWHERE, top_k=4, context="hint")
    batch = {"message_log": [[], []], "extra_env_info": [{"hint": [1, 2]}, {"hint": [3]}]}
    with served_teacher_in_setup(policy, module):
        module.run_multi_turn_rollout(policy_generation=None, input_batch=batch)
        assert seen == [batch] and policy.rollout_values == [[1, 2], [3]]
        teacher_batch = policy.privileged(*_rows(), _data(), "hint")
        assert [s.tolist() for s in teacher_batch.sequences] == [[1, 2, 7, 8], [3, 2, 3, 4, 9]]
        assert policy.rollout_values is None  # used once: the next step's rollout gives its own
        with pytest.raises(ValueError, match=r"sample 1 has no context under 'hint'.*extra_env_info holds \['x'\]"):
            module.run_multi_turn_rollout(input_batch={"message_log": [[], []],
                                                       "extra_env_info": [{"hint": [1]}, {"x": 1}]})
        assert len(seen) == 1  # refused before the rollout ran
    assert module.run_multi_turn_rollout is rollout


def test_a_batch_field_wins_over_extra_env_info_and_counts_are_checked():
    assert batch_contexts({"message_log": [[]], "hint": ["a"], "extra_env_info": [{"hint": "b"}]}, "hint") == ["a"]
    with pytest.raises(ValueError, match=r"field 'hint' holds 2 values for 1 samples"):
        batch_contexts({"message_log": [[]], "hint": ["a", "b"]}, "hint")
    with pytest.raises(ValueError, match=r"no field 'hint' and no extra_env_info"):
        batch_contexts({"message_log": [[]]}, "hint")
