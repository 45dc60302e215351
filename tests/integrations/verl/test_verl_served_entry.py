"""MEGATRON_RL_PATCHES_VERL_TEACHER's entry read (`integrations.verl.entry.parse_entry`, through the
teachers' grammar): the URL and engine, and each refusal naming the variable. No verl and no server needed; the served
teacher itself runs in the verl lane against a real vLLM server (lane/test_verl_served.py)."""
from __future__ import annotations

import types

import pytest

from megatron_rl_patches.integrations.verl.entry import parse_entry

VARIABLE = "MEGATRON_RL_PATCHES_VERL_TEACHER"


def read(entry: str) -> tuple:
    """(url, engine, head) of an entry."""
    parsed = parse_entry(entry)
    return parsed.path, parsed.engine, parsed.head


def test_url_and_engine_are_read_and_the_trailing_slash_dropped():
    assert read("http://teacher:8000/;engine=vllm") == ("http://teacher:8000", "vllm", None)
    assert read(" https://teacher:8443 ; engine = vllm ") == ("https://teacher:8443", "vllm", None)


def test_a_head_names_the_teachers_directory():
    entry = parse_entry("http://teacher:8000;engine=vllm;head=/ckpt/qwen3")
    assert read("http://teacher:8000;engine=vllm;head=/ckpt/qwen3") == ("http://teacher:8000", "vllm", "/ckpt/qwen3")
    assert entry.head == "/ckpt/qwen3"


@pytest.mark.parametrize("entry, message", [
    ("http://teacher:8000", r"name the engine serving it, e.g. 'http://teacher:8000;engine=vllm'"),
    ("http://teacher:8000;engine=vllm;tp=2", r"option 'tp=2': a served teacher runs at its server's own layout"),
    ("http://teacher:8000;engine=vllm;engine=vllm", r"option 'engine' given twice"),
    ("http://teacher:8000;engine=nope", r"engine"),
    ("http://teacher:8000;engine=vllm;head=", r"head= names the teacher's Hugging Face directory"),
    ("http://teacher:8000;engine=vllm;head=/a;head=/b", r"option 'head' given twice"),
    ("http://teacher:8000;engine=vllm;same_tokenizer;vocab=8", r"\['same_tokenizer', 'vocab='\] are slime's"),
    ("/ckpt/teacher;engine=vllm", r"expected http\(s\)://host:port;engine=vllm .* or student;context=KEY"),
    ("ftp://teacher:8000;engine=vllm", r"http"),
    ("http://user:secret@teacher:8000;engine=vllm", r"carries a user or password"),
])
def test_bad_entries_are_refused_naming_the_variable(entry, message):
    with pytest.raises(ValueError, match=message) as refused:
        parse_entry(entry)
    assert str(refused.value).startswith((f"{VARIABLE}=", f"{VARIABLE}: "))  # the one userinfo refusal: "VAR: "
    assert "secret" not in str(refused.value)


def test_a_privileged_context_names_its_field_and_the_teachers_tokenizer():
    entry = parse_entry("http://teacher:8000;engine=vllm;context=hint;tokenizer=/ckpt/qwen3")
    assert (entry.context, entry.tokenizer, entry.head) == ("hint", "/ckpt/qwen3", None)
    assert parse_entry("http://teacher:8000;engine=vllm;context=hint").tokenizer is None


@pytest.mark.parametrize("entry, message", [
    ("http://teacher:8000;engine=vllm;context=", r"';context=' names no key"),
    ("http://teacher:8000;engine=vllm;context=a;context=b", r"option 'context' given twice"),
    ("http://teacher:8000;engine=vllm;tokenizer=/ckpt", r"tokenizer= reads text contexts and there is no context"),
])
def test_bad_context_options_are_refused_naming_the_variable(entry, message):
    with pytest.raises(ValueError, match=message) as refused:
        parse_entry(entry)
    assert str(refused.value).startswith(f"{VARIABLE}=")


@pytest.mark.parametrize("entry, read", [
    ("student;context=hint", ("hint", None)),
    (" student ; context = hint ; tokenizer = /ckpt/student ", ("hint", "/ckpt/student")),
    ("http://student:8000;engine=vllm;context=hint", None),  # a host named so: a served teacher
    ("", None),
])
def test_the_live_self_teacher_is_read_for_verls_trainer(entry, read, monkeypatch):
    """`student;context=KEY`: scored on verl's trainer by the student's own model (lane:
    lane/test_verl_self_teacher.py); the variable's one reader reads it as the live self-teacher."""
    from megatron_rl_patches.integrations.verl.entry import verl_teacher

    monkeypatch.setenv(VARIABLE, entry)
    assert verl_teacher(types.SimpleNamespace()).self_teacher == read
    if read is not None:
        parsed = parse_entry(entry)
        assert (parsed.kind, parsed.context, parsed.tokenizer, parsed.other_tokenizer) == ("student", *read, False)


@pytest.mark.parametrize("entry, message", [
    (" student ", r"needs a privileged context, 'student;context=KEY'"),
    ("student;context=hint;engine=vllm", r"unknown option\(s\) \['engine=vllm'\]"),
    ("student;context=hint;tokenizer=", r"tokenizer= needs the teacher's tokenizer directory"),
])
def test_a_bad_live_self_teacher_entry_is_refused_naming_verls_variable(entry, message, monkeypatch):
    from megatron_rl_patches.integrations.verl.entry import verl_teacher

    monkeypatch.setenv(VARIABLE, entry)
    with pytest.raises(ValueError, match=message) as refused:
        verl_teacher(types.SimpleNamespace())  # read at a door: refused there
    words = str(refused.value)
    assert words.startswith(f"{VARIABLE}=") and "OPD_TEACHERS" not in words
    assert "student;context=KEY[;tokenizer=DIR]" in words


def test_the_agent_loop_stores_zero_rows_of_verls_layout_for_the_live_self_teacher():
    from megatron_rl_patches.integrations.verl.self_entry import placeholder_rows

    ids, log_probs = placeholder_rows([5, 6, 7, 8], 3)
    assert ids.shape == log_probs.shape == (4, 3) and ids.dtype.is_floating_point is False
    assert not ids.any() and not log_probs.any() and placeholder_rows([5, 6], 0)[0].shape == (2, 1)


@pytest.mark.parametrize("entry", ["student;context=hint;tokenizer=/a;tokenizer=/b",
                                   "student;tokenizer=/a;context=hint;tokenizer=/a"])
def test_a_repeated_option_of_the_live_self_teacher_is_refused_as_slimes_grammar_refuses_it(entry, monkeypatch):
    """issue 86 item 8: the second `;tokenizer=` was dropped silently; the teachers' grammar refuses
    an option given twice (slime's MEGATRON_RL_PATCHES_OPD_TEACHERS does), naming verl's variable."""
    from megatron_rl_patches.integrations.verl.entry import verl_teacher

    monkeypatch.setenv(VARIABLE, entry)
    with pytest.raises(ValueError, match=r"option 'tokenizer' given twice") as refused:
        verl_teacher(types.SimpleNamespace())  # read at a door: refused there
    assert str(refused.value).startswith(f"{VARIABLE}=") and "OPD_TEACHERS" not in str(refused.value)


@pytest.mark.parametrize("entry", ["student;tokenizer=https://bob:pw@h/t", "student;context=hint;tokenizer=https://bob:pw@h/t",
                                   "student;context=hint;tokenizer=https://bob:pw@h/t;engine=vllm"])
def test_a_password_in_the_live_self_teachers_entry_is_never_shown(entry, monkeypatch):
    """issue 86 item 8: `student;tokenizer=https://bob:pw@h/t` was quoted raw in the trainer's
    refusals; the user or password is refused where the variable is read, redacted."""
    from megatron_rl_patches.integrations.verl.entry import verl_teacher

    monkeypatch.setenv(VARIABLE, entry)
    with pytest.raises(ValueError, match=r"carries a user or password") as refused:
        verl_teacher(types.SimpleNamespace())  # read at a door: refused there
    words = str(refused.value)
    assert words.startswith(VARIABLE) and "pw" not in words and "bob" not in words and "***@h/t" in words
