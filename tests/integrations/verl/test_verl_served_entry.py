"""MEGATRON_RL_PATCHES_VERL_TEACHER's entry read (`integrations.verl.served.parse_entry`): the URL
and engine, and each refusal naming the variable. No verl and no server needed; the served
teacher itself runs in the verl lane against a real vLLM server (lane/test_verl_served.py)."""
from __future__ import annotations

import pytest

from megatron_rl_patches.integrations.verl.served import parse_entry

VARIABLE = "MEGATRON_RL_PATCHES_VERL_TEACHER"


def test_url_and_engine_are_read_and_the_trailing_slash_dropped():
    assert parse_entry("http://teacher:8000/;engine=vllm")[:3] == ("http://teacher:8000", "vllm", None)
    assert parse_entry(" https://teacher:8443 ; engine = vllm ")[:3] == ("https://teacher:8443", "vllm", None)


def test_a_head_names_the_teachers_directory():
    entry = parse_entry("http://teacher:8000;engine=vllm;head=/ckpt/qwen3")
    assert entry[:3] == ("http://teacher:8000", "vllm", "/ckpt/qwen3") and entry.head == "/ckpt/qwen3"


@pytest.mark.parametrize("entry, message", [
    ("http://teacher:8000", r"name the engine serving it, e.g. 'http://teacher:8000;engine=vllm'"),
    ("http://teacher:8000;engine=vllm;tp=2", r"option 'tp=2' is unknown or given twice"),
    ("http://teacher:8000;engine=vllm;engine=vllm", r"option 'engine=vllm' is unknown or given twice"),
    ("http://teacher:8000;engine=nope", r"engine"),
    ("http://teacher:8000;engine=vllm;head=", r"head= names the teacher's Hugging Face directory"),
    ("http://teacher:8000;engine=vllm;head=/a;head=/b", r"option 'head=/b' is unknown or given twice"),
    ("ftp://teacher:8000;engine=vllm", r"http"),
    ("http://user:secret@teacher:8000;engine=vllm", r"carries a user or password"),
])
def test_bad_entries_are_refused_naming_the_variable(entry, message):
    with pytest.raises(ValueError, match=message) as refused:
        parse_entry(entry)
    assert str(refused.value).startswith(f"{VARIABLE}=")
    assert "secret" not in str(refused.value)


def test_a_privileged_context_names_its_field_and_the_teachers_tokenizer():
    entry = parse_entry("http://teacher:8000;engine=vllm;context=hint;tokenizer=/ckpt/qwen3")
    assert (entry.context, entry.tokenizer, entry.head) == ("hint", "/ckpt/qwen3", None)
    assert parse_entry("http://teacher:8000;engine=vllm;context=hint").tokenizer is None


@pytest.mark.parametrize("entry, message", [
    ("http://teacher:8000;engine=vllm;context=", r"context= needs a value"),
    ("http://teacher:8000;engine=vllm;context=a;context=b", r"option 'context=b' is unknown or given twice"),
    ("http://teacher:8000;engine=vllm;tokenizer=/ckpt", r"tokenizer= reads text contexts and there is no context"),
])
def test_bad_context_options_are_refused_naming_the_variable(entry, message):
    with pytest.raises(ValueError, match=message) as refused:
        parse_entry(entry)
    assert str(refused.value).startswith(f"{VARIABLE}=")


@pytest.mark.parametrize("entry", ["student;context=hint", " student ", "student;context=hint;engine=vllm"])
def test_the_live_self_teacher_is_refused_by_name_naming_the_routes_that_take_it(entry):
    """verl scores its teacher in the agent loop, where the student's current weights are not."""
    with pytest.raises(ValueError) as refused:
        parse_entry(entry)
    words = str(refused.value)
    assert words.startswith(f"{VARIABLE}=") and "the live self-teacher" in words and "not hosted in verl" in words
    assert "MEGATRON_RL_PATCHES_OPD_TEACHERS='student;context=KEY'" in words and "LoopHost(" in words
    assert "self_teacher_policy(context=KEY)" in words
    assert parse_entry("http://student:8000;engine=vllm;context=hint").url == "http://student:8000"  # a host named so
