"""Full-vocabulary OPD in slime (MEGATRON_RL_PATCHES_OPD_K=vocab) without slime's source: the setting
is read, the teachers that give hidden states over the student's vocabulary are taken, every other
one is refused by name when the settings are read (before anything loads), and the training step
asks the fused call for the divergence. (Through slime's real train_actor at four layouts:
tests/integrations/slime/lane/test_slime_opd_vocab_lane.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl_patches.integrations.megatron.opd import hidden_teachers
from megatron_rl_patches.integrations.megatron.opd.opd_settings import LOSS_PATH, opd_settings
from megatron_rl_patches.integrations.megatron.opd.opd_teachers import SeparateTeacher, SnapshotTeacher
from megatron_rl_patches.integrations.megatron.opd.topk_request import TEACHER_HEADS, TEACHER_HIDDEN, VocabRequest
from megatron_rl_patches.integrations.slime import fused_step as plan
from megatron_rl_patches.integrations.slime import opd as slime_opd

P = "MEGATRON_RL_PATCHES_OPD_"
HEAD = "http://t:1;engine=vllm;head=/dirs/teacher"


def _args(**values):
    base = dict(loss_type="custom_loss", custom_loss_function_path=LOSS_PATH, context_parallel_size=1,
                rollout_temperature=0.7)
    return SimpleNamespace(**{**base, **values})


@pytest.mark.parametrize("teachers", ["/a,/b", f"/a,{HEAD}", "/a@m:f", f"{HEAD}", "/hf/qwen3"])
def test_vocab_takes_snapshots_separate_models_and_served_heads(teachers):
    settings = opd_settings({P + "TEACHERS": teachers, P + "K": "vocab", P + "DIVERGENCE": "jsd"})
    assert settings is not None and settings.full_vocab and settings.divergence == "jsd"
    slime_opd.check_args(_args(), settings)  # slime's flags and the entries' own checks: nothing refused
    assert not opd_settings({P + "TEACHERS": teachers, P + "K": "8"}).full_vocab  # type: ignore[union-attr]


@pytest.mark.parametrize("env, words", [
    ({"TEACHERS": "/a,http://t:2;engine=vllm"}, "entry 'http://t:2' is a served teacher without a head.*';head=DIR'"),
    ({"TEACHERS": "/a,/b;tokenizer=own"}, "entry '/b' has another tokenizer"),
    ({"TEACHERS": "http://t:1;engine=vllm;tokenizer=/tok"}, "entry 'http://t:1' has another tokenizer"),
    ({"TEACHERS": "/hf/a;tp=2"}, "entry '/hf/a' ';tp=2': a teacher at its own layout"),
    ({"TEACHERS": "/a", "IDS_FROM": "union"}, "IDS_FROM=union: the full vocabulary selects no ids"),
    ({"TEACHERS": f"{HEAD}", "IDS_FROM": "teacher"}, "IDS_FROM=teacher: the full vocabulary selects no ids"),
])
def test_what_vocab_cannot_serve_is_refused_by_name_when_read(env, words):
    with pytest.raises(ValueError, match=f"{P}K=vocab: .*{words}"):
        opd_settings({**{P + name: value for name, value in env.items()}, P + "K": "vocab"})


@pytest.mark.parametrize("raw", ["vocabulary", "0", "-3", "full"])
def test_a_bad_k_names_both_forms(raw):
    with pytest.raises(ValueError, match=f"{P}K='{raw}': expected an integer k > 0 .* or 'vocab'"):
        opd_settings({P + "TEACHERS": "/a", P + "K": raw})


def test_vocab_is_read_in_any_case_and_with_spaces():
    assert opd_settings({P + "TEACHERS": "/a", P + "K": " VOCAB "}).full_vocab  # type: ignore[union-attr]


def test_the_training_step_asks_for_the_divergence_and_the_teachers_fields(monkeypatch):
    monkeypatch.setenv(P + "TEACHERS", "/a,/b")
    monkeypatch.setenv(P + "WEIGHTS", "0.25,0.75")
    monkeypatch.setenv(P + "DIVERGENCE", "forward_kl")
    monkeypatch.setenv(P + "K", "vocab")
    args = _args()
    request = plan.step_request(args, plan.slime_settings(args))
    assert isinstance(request, VocabRequest) and not request.hidden
    assert request.keys == (TEACHER_HIDDEN, TEACHER_HEADS)
    assert (request.divergence, request.weights) == ("forward_kl", (0.25, 0.75))
    other = _args(custom_loss_function_path="x.y")
    assert plan.step_request(other, plan.slime_settings(other)) is None  # not top-k OPD's loss: nothing


def test_log_rollout_data_never_sees_the_teachers_fields():
    seen = []

    def log_rollout_data(rollout_id, args, rollout_data):
        seen.append(sorted(rollout_data))

    data = {"tokens": [1], TEACHER_HIDDEN: [(1,)], TEACHER_HEADS: [object()]}
    slime_opd.log_rollout_data_wrapper(log_rollout_data, None, (0, None, data), {})
    assert seen == [["tokens"]] and TEACHER_HIDDEN in data  # the step still reads them


def _chunk(vocab):
    return SimpleNamespace(vocab_size=vocab)


def test_a_separate_teacher_padded_otherwise_is_refused_at_load():
    actor = SimpleNamespace(model=[SimpleNamespace(module=_chunk(128))])
    hidden_teachers.check_loaded(actor, [SnapshotTeacher("opd_teacher_0"), SeparateTeacher([_chunk(128)])])
    with pytest.raises(ValueError, match="teacher 1 .* padded vocabulary of 256, the student 128"):
        hidden_teachers.check_loaded(actor, [SnapshotTeacher("opd_teacher_0"), SeparateTeacher([_chunk(256)])])


def test_a_training_step_without_the_teachers_fields_is_a_clear_error():
    from megatron_rl_patches.integrations.megatron.opd.fused_context import NOT_SCORED, vocab_processor

    with pytest.raises(RuntimeError, match="found no teacher hidden states") as error:
        vocab_processor(VocabRequest(), lambda **_: {}, {"temperature": 1.0}, {"tokens": [1]}, list, 4, "cpu", False)
    assert str(error.value) == NOT_SCORED
