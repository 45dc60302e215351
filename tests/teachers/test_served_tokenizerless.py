"""A served teacher without a tokenizer (vLLM started with `--skip-tokenizer-init` answers
`/tokenize` with HTTP 400 "Tokenizer not available when `skip_tokenizer_init=True`"): the
tokenizer check's refusal names the flag and the way out; the entry's `;same_tokenizer` with
`;vocab=N` or `;config=PATH` is accepted, the named vocabulary checked against the student's
tokenizer, never by sending ids. The server here is a local one answering as vLLM 0.32 does (its
error words read from vLLM's `renderers/base.py`); the served lane runs the same against a real
vLLM started with the flag (`lane/test_served_tokenizerless_vllm.py`)."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

import pytest

from megatron_rl_patches.teachers import ScoringPlan, ServedTeacher
from megatron_rl_patches.teachers.kinds import parse_entry
from megatron_rl_patches.teachers.served.tokenizer_probe import probe_tokenizer
from tests.teachers.local_servers import url_of, vllm_like

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
pytest.importorskip("tokenizers", reason="the tokenizers library is missing")

STUDENT_WORDS = 50
NO_TOKENIZER = (400, {"error": {"message": "Tokenizer not available when `skip_tokenizer_init=True`",
                                "type": "BadRequestError", "param": None, "code": 400}})


def tokenizerless():
    return vllm_like(tokenize=lambda _: NO_TOKENIZER)


@pytest.fixture
def student(tmp_path):
    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path, STUDENT_WORDS)
    return tmp_path


def test_the_refusal_names_the_flag_and_the_way_out(student):
    from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer

    with tokenizerless() as server, ServedTeacher(url_of(server), top_k=2) as teacher:
        with pytest.raises(ValueError, match=r"started with --skip-tokenizer-init.*Tokenizer not available.*say so in "
                                             r"the entry with ';same_tokenizer'.*';vocab=N' or ';config=PATH'"):
            probe_tokenizer(teacher, load_tokenizer(str(student), "student"), "the entry")


@pytest.mark.parametrize(("options", "field", "value"), [
    (";same_tokenizer;vocab=151936", "vocab", 151936),
    (";same_tokenizer;config=/t/config.json", "config", "/t/config.json"),
])
def test_same_tokenizer_is_read(options, field, value):
    entry = parse_entry(f"http://h:1;engine=vllm{options}")
    assert entry.same_tokenizer and getattr(entry, field) == value and not entry.other_tokenizer


@pytest.mark.parametrize(("options", "words"), [
    (";same_tokenizer", "exactly one of ';vocab=N' or ';config=PATH'"),
    (";same_tokenizer;vocab=5;config=/c", "exactly one of"),
    (";vocab=5", "add ';same_tokenizer'"),
    (";same_tokenizer;vocab=0", "a positive int"),
    (";same_tokenizer;vocab=ten", "a positive int"),
    (";same_tokenizer;vocab=5;tokenizer=/t", "contradict each other"),
])
def test_same_tokenizer_options_are_refused_by_name(options, words):
    with pytest.raises(ValueError, match=words):
        parse_entry(f"http://h:1;engine=vllm{options}")


def connected(student, server, entry):
    """slime's served teacher connected as its builder does (`served_teacher.served_own`)."""
    from megatron_rl_patches.integrations.megatron.opd.served_teacher import served_own
    from megatron_rl_patches.integrations.megatron.opd.stage_host import stage_host
    from megatron_rl_patches.teachers.named_vocab import named_vocab_size

    args = SimpleNamespace(hf_checkpoint=str(student))
    teacher = parse_entry(entry)
    named = named_vocab_size(teacher, "the entry")
    settings = cast(Any, SimpleNamespace(plan=lambda: ScoringPlan(2)))  # the OPD settings' plan: K = 2
    return served_own(args, settings, teacher, stage_host(STUDENT_WORDS), "the entry", named).teacher


def test_the_users_word_is_taken_with_the_vocabulary_checked(student, tmp_path):
    config = tmp_path / "teacher"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"vocab_size": 64}))
    with tokenizerless() as server:
        connected(student, server, f"{url_of(server)};engine=vllm;same_tokenizer;config={config}").close()
        connected(student, server, f"{url_of(server)};engine=vllm;same_tokenizer;vocab={STUDENT_WORDS}").close()
        with pytest.raises(ValueError, match=rf"writes ids up to {STUDENT_WORDS - 1}, past the served model's "
                                             r"vocabulary of 40"):
            connected(student, server, f"{url_of(server)};engine=vllm;same_tokenizer;vocab=40")
        # never a /tokenize, never an id of the student's (the check's probe sends id 0 only)
        assert "/tokenize" not in [path for path, _ in server.seen]


def test_doctor_reads_the_named_vocabulary(monkeypatch, tmp_path):
    from megatron_rl_patches.apps.cli import doctor

    with tokenizerless() as server:
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_K", "2")
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", f"{url_of(server)};engine=vllm;same_tokenizer;vocab=64")
        assert doctor.teacher_problems() == []
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS",
                           f"{url_of(server)};engine=vllm;same_tokenizer;config={tmp_path}")
        (problem,) = doctor.teacher_problems()
        assert f"';config={tmp_path}' is no readable config.json" in problem, problem
