"""`head_logit_scale` (`teachers.head.transforms`) on config dicts, in one process: a config
without architectures (none anywhere, or only its text_config's) and each refusal matched whole,
where `test_head_transforms.py` (checkpoints on disk, through `TeacherHead.from_hf`) matches the
field named."""
from __future__ import annotations

import pytest

from megatron_rl_patches.teachers.head.transforms import head_logit_scale

REST = ("; the served hidden states do not carry it, and the head forms h·Wᵀ/τ times a scale only, so this "
        "teacher's distribution cannot be formed from its head (use an in-process teacher, or a served teacher's "
        "top-k without head=; docs/distillation.md lists the transforms applied)")


def refusal(fields: dict, text: dict, tensors: set) -> str:
    with pytest.raises(ValueError) as raised:
        head_logit_scale(fields, text, tensors, "ckpt")
    return str(raised.value)


def test_a_config_without_architectures_is_served_as_it_is_or_refused_naming_that():
    assert head_logit_scale({}, {}, set(), "ckpt") == 1.0
    assert head_logit_scale({"architectures": []}, {}, set(), "ckpt") == 1.0
    assert refusal({"logit_scale": 0.5}, {}, set()) == (
        "TeacherHead.from_hf: 'ckpt''s config.json (no architectures) sets logit_scale=0.5: a logits transform whose "
        "effect vLLM 0.32 gives for other architectures only (not known for a config without architectures)" + REST)


def test_the_architecture_is_read_from_the_text_config_where_config_json_names_none():
    assert head_logit_scale({}, {"architectures": ["ExaoneMoeForCausalLM"], "logit_scale": 0.5}, set(), "ckpt") == 0.5


def test_an_output_layer_bias_is_refused_whole():
    assert refusal({"architectures": ["GPTJForCausalLM"]}, {}, {"lm_head.weight", "lm_head.bias"}) == (
        "TeacherHead.from_hf: 'ckpt''s config.json (GPTJForCausalLM) sets lm_head.bias='a tensor': the output layer "
        "has a bias, which the engine adds to the logits" + REST)


def test_a_missing_mup_scale_factor_is_refused_whole():
    assert refusal({"architectures": ["TeleFLMForCausalLM"], "use_mup": True, "output_mult": 3.0}, {}, set()) == (
        "TeacherHead.from_hf: 'ckpt''s config.json sets mup_scale_factor=None; a logits multiplier must be a finite "
        "non-zero number")
