"""slime_opd without slime's source: the settings' checks (each error names the variable to
change, before any step) and the mechanics (packed ids, the step's top-k request)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl_patches.integrations.megatron.opd import opd_teachers, teacher_builders
from megatron_rl_patches.integrations.megatron.opd import topk_request as keys
from megatron_rl_patches.integrations.megatron.opd.opd_settings import LOSS_PATH, Teacher, opd_settings
from megatron_rl_patches.integrations.slime import fused_step as plan
from megatron_rl_patches.integrations.slime import opd as slime_opd
from megatron_rl_patches.ops.packing import packed_ids

P = "MEGATRON_RL_PATCHES_OPD_"


def test_unset_teachers_switch_opd_off():
    assert opd_settings({}) is None


def test_settings_parsed():
    s = opd_settings({P + "TEACHERS": "/a, /b@pkg.mod:provider", P + "WEIGHTS": "0.25,0.75", P + "K": "8",
                      P + "DIVERGENCE": "jsd", P + "COEF": "0.5", P + "POLICY_WEIGHT": "2", P + "RESIDENCY": "Stream"})
    assert s.teachers == (Teacher("/a"), Teacher("/b", "pkg.mod:provider"))
    assert s.teachers[0].same_architecture and not s.teachers[1].same_architecture
    assert (s.weights, s.k, s.divergence, s.coef, s.policy_weight) == ((0.25, 0.75), 8, "jsd", 0.5, 2.0)
    assert s.residency == "stream"
    assert opd_settings({P + "TEACHERS": "/a,/b,/c", P + "WEIGHTS": "0.1,0.2,0.7"}).weights == (0.1, 0.2, 0.7)
    assert s.ids_from == "student"
    assert opd_settings({P + "TEACHERS": "/a", P + "IDS_FROM": "union"}).ids_from == "union"
    assert opd_settings({P + "TEACHERS": "/a,/b;tokenizer=own", P + "IDS_FROM": "teacher"}).ids_from == "teacher"


@pytest.mark.parametrize("env, named", [
    ({P + "TEACHERS": " , "}, P + "TEACHERS"),
    ({P + "TEACHERS": "/a", P + "K": "0"}, P + "K"),
    ({P + "TEACHERS": "/a", P + "K": "-3"}, P + "K"),
    ({P + "TEACHERS": "/a,/b", P + "WEIGHTS": "1"}, P + "WEIGHTS"),
    ({P + "TEACHERS": "/a", P + "WEIGHTS": "-1"}, P + "WEIGHTS"),
    ({P + "TEACHERS": "/a", P + "DIVERGENCE": "kl"}, P + "DIVERGENCE"),
    ({P + "TEACHERS": "/a@noprovider"}, P + "TEACHERS"),
    ({P + "TEACHERS": "/a", P + "COEF": "nan"}, P + "COEF"),
    ({P + "TEACHERS": "/a", P + "IDS_FROM": "teachers"}, P + "IDS_FROM"),
    ({P + "TEACHERS": "/a;tokenizer=own,/b", P + "IDS_FROM": "teacher"}, P + "IDS_FROM=teacher with a first teacher of "
                                                                          "another tokenizer"),
    # issue 38: checked when the settings are read, naming the variable (not at the teacher's load)
    ({P + "TEACHERS": "/a@:fn"}, P + "TEACHERS"),
    ({P + "TEACHERS": "/a@mod:"}, P + "TEACHERS"),
    ({P + "TEACHERS": "/a@ : "}, P + "TEACHERS"),
    ({P + "TEACHERS": "/a@mod.:fn"}, P + "TEACHERS"),
    ({P + "TEACHERS": "/a@my-models:fn"}, P + "TEACHERS"),
    ({P + "TEACHERS": "/a", P + "RESIDENCY": "stram"}, P + "RESIDENCY"),
    ({P + "TEACHERS": "/a", P + "RESIDENCY": "on"}, P + "RESIDENCY"),
    ({P + "TEACHERS": "/a,/b", P + "WEIGHTS": "1,1"}, P + "WEIGHTS"),
    ({P + "TEACHERS": "/a,/b", P + "WEIGHTS": "2,3"}, P + "WEIGHTS"),
    ({P + "TEACHERS": "/a,/b", P + "WEIGHTS": "0.25,0.25"}, P + "WEIGHTS"),
])
def test_bad_settings_name_the_variable(env, named):
    with pytest.raises(ValueError, match=named):
        opd_settings(env)


def _args(**values):
    base = dict(loss_type="custom_loss", custom_loss_function_path=LOSS_PATH, context_parallel_size=1)
    return SimpleNamespace(**{**base, **values})


@pytest.mark.parametrize("provider", ["no_such_module_xyz:fn", "json:no_such_function", "json:__doc__"])
def test_a_teacher_provider_that_cannot_load_names_the_variable(provider):
    with pytest.raises(ValueError, match=f"{P}TEACHERS: teacher provider '{provider}'"):
        teacher_builders.separate_teacher(None, Teacher("/a", provider), None)


def test_slime_flags_checked_before_the_first_step():
    slime_opd.check_args(_args())
    # the documented path users type, and the loss's module path: both are top-k OPD's loss
    for path in ("megatron_rl_patches.integrations.slime_opd.topk_opd_policy_loss",
                 "megatron_rl_patches.integrations.slime.opd.topk_opd_policy_loss"):
        slime_opd.check_args(_args(custom_loss_function_path=path))
    with pytest.raises(ValueError, match="--custom-loss-function-path"):
        slime_opd.check_args(_args(loss_type="policy_loss"))
    slime_opd.check_args(_args(context_parallel_size=2, allgather_cp=False))  # slime's zigzag: served
    slime_opd.check_args(_args(context_parallel_size=2, allgather_cp=True))  # contiguous slices: served
    slime_opd.check_args(_args(context_parallel_size=1, allgather_cp=True))


@pytest.mark.parametrize("values, env, flag", [
    ({"rollout_top_p": 0.9}, {}, "rollout_top_p"),
    ({"enable_mtp_training": True}, {}, "enable_mtp_training"),
    ({}, {"ENABLE_ROUTING_REPLAY": "1"}, "ENABLE_ROUTING_REPLAY=1"),
])
def test_a_configuration_slime_fused_sends_to_the_logits_path_is_refused_before_the_first_step(
        monkeypatch, values, env, flag):
    """A fallback inside a teacher pass would raise on the last pipeline stage only (the others
    wait in the next pass): what slime_fused cannot serve is refused up front, naming the flag."""
    from megatron_rl_patches.integrations.slime.fused import unservable

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = _args(**values)
    if unservable(args) is None:  # served by the fused route (then a teacher pass serves it too)
        slime_opd.check_args(args)
        return
    with pytest.raises(ValueError, match=f"{P}TEACHERS is set with .*{flag}.*drop that flag"):
        slime_opd.check_args(args)


def test_step_request_only_with_teachers_and_this_loss(monkeypatch):
    def request(args):  # the settings as slime's door reads them for this `args`, then the step's request
        return plan.step_request(args, plan.slime_settings(args))

    monkeypatch.delenv(P + "TEACHERS", raising=False)
    assert request(_args()) is None
    monkeypatch.setenv(P + "TEACHERS", "/a")
    assert request(_args()) is opd_teachers.STEP_REQUEST
    assert request(_args(custom_loss_function_path="x.y")) is None
    new_path = "megatron_rl_patches.integrations.slime.opd.topk_opd_policy_loss"
    assert request(_args(custom_loss_function_path=new_path)) is opd_teachers.STEP_REQUEST
    monkeypatch.setenv(P + "IDS_FROM", "union")
    union = request(_args())
    assert union is opd_teachers.UNION_STEP_REQUEST and union.mask_key == keys.IDS_MASK
    assert keys.IDS_MASK in union.keys
    monkeypatch.setenv(P + "IDS_FROM", "teacher")  # the first teacher's own top-k: [R, k], no padding
    assert request(_args()) is opd_teachers.STEP_REQUEST


class _Actor:
    """A slime actor's snapshot surface (TensorBackuper tags) for load_teachers."""

    def __init__(self, shapes):
        self.args, self.switched = _args(), []
        self.model = [SimpleNamespace(vocab_size=64)]
        own = {"w": torch.zeros(4, 2)}
        self.weights_backuper = SimpleNamespace(get=lambda tag: own if tag == "actor" else {"w": torch.zeros(shapes)})

    def load_other_checkpoint(self, tag, path):
        self.switched.append(tag)

    def _switch_model(self, tag):
        self.switched.append(tag)


def test_snapshot_teachers_loaded_the_slime_way_and_actor_restored():
    actor = _Actor((4, 2))
    settings = opd_settings({P + "TEACHERS": "/a,/b"})
    assert slime_opd.load_teachers(actor, settings) == ["opd_teacher_0", "opd_teacher_1"]
    assert actor.switched == ["opd_teacher_0", "opd_teacher_1", "actor"]


def test_snapshot_teacher_of_other_shape_is_refused():
    with pytest.raises(ValueError, match=P + "TEACHERS"):
        slime_opd.load_teachers(_Actor((5, 2)), opd_settings({P + "TEACHERS": "/a"}))


def test_separate_teacher_vocab_must_match(monkeypatch):
    monkeypatch.setattr(teacher_builders, "separate_teacher", lambda *a: [SimpleNamespace(vocab_size=65)])
    with pytest.raises(ValueError, match="vocabulary 65"):
        slime_opd.load_teachers(_Actor((4, 2)), opd_settings({P + "TEACHERS": "/a@m:f"}))


def test_packed_ids_place_each_sample_on_its_rows():
    ids = packed_ids([torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5, 6]])],
                     [torch.tensor([1, 2]), torch.tensor([5])], 7)
    expected = torch.zeros(7, 2, dtype=torch.long)
    expected[1], expected[2], expected[5] = torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6])
    assert torch.equal(ids, expected)
    with pytest.raises(ValueError, match="expected \\[2, 2\\]"):
        packed_ids([torch.zeros(3, 2)], [torch.tensor([0, 1])], 4)


def test_packed_mask_places_each_sample_on_its_rows_and_pads_false():
    masks = [torch.tensor([[True, False], [True, True]]), torch.tensor([[False, True]])]
    packed = packed_ids(masks, [torch.tensor([1, 2]), torch.tensor([5])], 7, dtype=torch.bool)
    expected = torch.zeros(7, 2, dtype=torch.bool)
    expected[1], expected[2], expected[5] = masks[0][0], masks[0][1], masks[1][0]
    assert packed.dtype == torch.bool and torch.equal(packed, expected)


def test_a_top_k_pass_served_logits_is_a_clear_error():
    """A teacher's top-k pass that slime_fused sent to slime's logits path (a fallback) has no buckets."""
    with pytest.raises(RuntimeError, match="fell back to slime's logits path"):
        slime_opd.collect_topk(torch.zeros(1, 5, 8), total_lengths=[5], response_lengths=[2])


def test_every_divergence_of_the_table_is_a_setting():
    from megatron_rl_patches.ops._divergences import TABLE

    env = {"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/teacher"}
    for name in TABLE:
        settings = opd_settings({**env, "MEGATRON_RL_PATCHES_OPD_DIVERGENCE": name})
        assert settings is not None and settings.divergence == name


@pytest.mark.parametrize("teachers, ids_from, words", [
    ("http://t:1;engine=vllm,/b", "student", "IDS_FROM=student: a served engine scores its own top-k only"),
    ("http://t:1;engine=vllm,/b", "union", "IDS_FROM=union: a served engine scores its own top-k only"),
    ("/a,http://t:1;engine=vllm", "teacher", "entry 'http://t:1': a served teacher after the first"),
    ("http://t:1;engine=vllm,http://t:2;engine=vllm", "teacher", "entry 'http://t:2': a served teacher after the "
                                                                 "first"),
    ("/a;tokenizer=own,http://t:1;engine=vllm", "student", "IDS_FROM=student: a served engine scores its own"),
])
def test_what_a_served_teacher_cannot_serve_is_refused_naming_the_entry(teachers, ids_from, words):
    settings = opd_settings({P + "TEACHERS": teachers, P + "IDS_FROM": ids_from})
    with pytest.raises(ValueError, match=words):
        slime_opd.check_args(_args(rollout_temperature=1.0), settings)
    fine = opd_settings({P + "TEACHERS": "http://t:1;engine=vllm,/b", P + "IDS_FROM": "teacher"})
    slime_opd.check_args(_args(rollout_temperature=1.0), fine)  # control: first, ids from it, temperature 1


@pytest.mark.parametrize("teachers, ids_from", [
    ("http://t:1;engine=vllm;tokenizer=/tok,/b", "student"),  # another tokenizer: its own encoding, any ids
    ("/b,http://t:1;engine=vllm;tokenizer=/tok", "union"),
    ("http://t:1;engine=vllm,/a;tokenizer=own,/b", "teacher"),  # the first, another tokenizer beside it
])
def test_a_served_teacher_of_another_tokenizer_takes_any_place_and_any_ids(teachers, ids_from):
    settings = opd_settings({P + "TEACHERS": teachers, P + "IDS_FROM": ids_from})
    slime_opd.check_args(_args(rollout_temperature=1.0), settings)
    with pytest.raises(ValueError, match="--rollout-temperature is 0.8: served engines score"):
        slime_opd.check_args(_args(rollout_temperature=0.8), settings)
