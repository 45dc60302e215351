"""Secrets never reach a message: a password in a served entry's URL (holding '@', '#', '/' or ';',
which cut a parsed authority short or are split off first) is refused on the raw text and shown
redacted in every error and `doctor` line; an API key that cannot be sent as written (white space
at an end, non-ASCII) is refused naming its variable, never echoed, never stripped."""
from __future__ import annotations

import json

import pytest

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher
from megatron_rl_patches.teachers.kinds import parse_entry
from megatron_rl_patches.teachers.redaction import redacted
from tests.teachers.local_servers import url_of, vllm_like

TEACHERS, KEY = "MEGATRON_RL_PATCHES_OPD_TEACHERS", "MEGATRON_RL_PATCHES_TEACHER_API_KEY"
# (the URL's userinfo, the pieces of it that must never be shown)
USERINFO = [
    ("bob:hunt@r2pw", ["hunt", "r2pw"]),
    ("bob:hu#nt2pw", ["hu#nt", "nt2pw"]),
    ("bob:hu/nt2pw", ["hu/nt", "nt2pw"]),
    ("bob:hu;nt2pw", ["hu;nt", "nt2pw"]),
    ("bob:plainpw", ["plainpw"]),
    (":onlypw", ["onlypw"]),
    ("tokenuser", ["tokenuser"]),
]


def entries(userinfo: str) -> list[str]:
    return [f"http://{userinfo}@teacher.example:8000;engine=vllm", f"https://{userinfo}@teacher.example",
            f"http://{userinfo}@teacher.example:8000/v1;engine=vllm;tokenizer=/t"]


@pytest.mark.parametrize(("userinfo", "secrets"), USERINFO)
def test_a_password_in_any_form_is_refused_and_never_shown(userinfo, secrets):
    for entry in entries(userinfo):
        assert not any(secret in redacted(entry) for secret in secrets), redacted(entry)
        with pytest.raises(ValueError, match="carries a user or password") as caught:
            parse_entry(entry)
        assert not any(secret in str(caught.value) for secret in secrets), caught.value
        with pytest.raises(ValueError, match="carries a user or password") as caught:
            ServedTeacher(entry.split(";engine")[0])
        assert not any(secret in str(caught.value) for secret in secrets), caught.value


@pytest.mark.parametrize(("userinfo", "secrets"), USERINFO)
def test_doctor_shows_no_password(userinfo, secrets, monkeypatch):
    from megatron_rl_patches.apps.cli import doctor

    monkeypatch.setenv(TEACHERS, ",".join(entries(userinfo)[:1] + ["http://127.0.0.1:9;engine=vllm"]))
    report = doctor.collect()
    text = json.dumps(report)
    assert any("carries a user or password" in problem for problem in report["problems"]), report["problems"]
    assert not any(secret in text for secret in secrets), [line for line in text.split(",") if "bob" in line]


def test_redaction_keeps_what_is_no_secret():
    assert redacted("a http://h:1;engine=vllm, https://u:p@h/x;tokenizer=/d b") == \
        "a http://h:1;engine=vllm, https://***@h/x;tokenizer=/d b"


@pytest.mark.parametrize(("key", "words"), [
    ("sk-s3cr3t\n", "ends with white space \\(a newline\\)"),
    ("sk-s3cr3t ", "ends with white space \\(a space or tab\\)"),
    (" sk-s3cr3t", "starts with white space"),
    ("sk-s3cr3t\u00e9", "holds a non-ASCII character at position 9"),
])
def test_an_api_key_that_cannot_be_sent_as_written_is_refused_by_its_variable(key, words, monkeypatch):
    pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    monkeypatch.setenv(KEY, key)
    with vllm_like() as server, ServedTeacher(url_of(server), top_k=2, client=ClientSettings(retries=0)) as teacher:
        with pytest.raises(ValueError, match=rf"\${KEY}, the served teacher's API key, {words}") as caught:
            teacher.check()
        assert "s3cr3t" not in str(caught.value) and not server.seen  # refused before anything is sent
        # doctor names it the same way
        from megatron_rl_patches.apps.cli import doctor

        monkeypatch.setenv(TEACHERS, f"{url_of(server)};engine=vllm")
        report = json.dumps(doctor.collect())
        assert "s3cr3t" not in report and f"${KEY}, the served teacher's API key" in report


def test_a_good_api_key_is_sent_as_a_bearer_token(monkeypatch):
    pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    monkeypatch.setenv(KEY, "sk-s3cr3t")
    with vllm_like() as server, ServedTeacher(url_of(server), top_k=2) as teacher:
        teacher.check()
    assert all(headers.get("Authorization") == "Bearer sk-s3cr3t" for _, headers in server.seen), server.seen
