"""A server that quotes the API key back (`invalid credentials: Bearer <key>`) in a 401, a 400 or
a 500 after the retries: the client takes its own key, any piece of it a server cut, and every
bearer token out of what it quotes, so no `ServedTeacherRefusal` / `ServedTeacherError` and no
`doctor` line holds it."""
from __future__ import annotations

import json

import pytest

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, ServedTeacherError, ServedTeacherRefusal
from tests.teachers.local_servers import url_of, vllm_like

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

KEY_VARIABLE, TEACHERS = "MEGATRON_RL_PATCHES_TEACHER_API_KEY", "MEGATRON_RL_PATCHES_OPD_TEACHERS"
KEY = "sk-s3cr3t-0123456789abcdef"
OTHER = "tok-0ther-bearer-value"  # a bearer token that is not ours, quoted too
PIECE = 8  # the shortest piece of the key that must not be shown


def key_pieces(text: str) -> list[str]:
    return [KEY[i:i + PIECE] for i in range(len(KEY) - PIECE + 1) if KEY[i:i + PIECE] in text] + \
        ([OTHER] if OTHER in text else [])


# route -> (status, body): the key in a JSON message, in detail, in a plain-text body, cut by the server
REPLIES = {
    "401_message": (401, {"error": {"message": f"invalid credentials: Bearer {KEY}", "type": "auth"}}),
    "401_other_bearer": (401, {"message": f"invalid credentials: bearer {OTHER}; expected another"}),
    "400_detail": (400, {"detail": f"api key {KEY} is not allowed to ask for prompt_logprobs"}),
    "400_cut": (400, {"detail": f"api key {KEY[:14]}... is not allowed"}),
    "500_text": (500, f"internal error while checking Authorization: Bearer {KEY}".encode()),
    "500_long_text": (500, ("x" * 490 + KEY + " and more").encode()),  # the key across the quote's cut
}


@pytest.fixture
def key(monkeypatch):
    for name in (KEY_VARIABLE, TEACHERS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    return monkeypatch


@pytest.mark.parametrize("reply", list(REPLIES))
@pytest.mark.parametrize("route", ["v1_models", "v1_completions"])
def test_a_server_quoting_the_key_is_quoted_without_it(reply, route, key):
    status, body = REPLIES[reply]
    with vllm_like(**{route: lambda _: (status, body)}) as server:
        settings = ClientSettings(retries=1, backoff_s=0.0)
        with ServedTeacher(url_of(server), top_k=2, client=settings) as teacher, \
                pytest.raises(ServedTeacherError) as failed:
            teacher.check()
    assert isinstance(failed.value, ServedTeacherRefusal) == (status < 500)
    said = str(failed.value)
    assert f"HTTP {status}" in said and ("after 2 tries" in said) == (status >= 500), said
    assert not key_pieces(said), said
    assert "***" in said, said  # what was hidden is said to be


def test_doctor_quotes_a_server_quoting_the_key_without_it(key, capsys):
    from megatron_rl_patches.apps.cli import main

    status, body = REPLIES["401_message"]
    with vllm_like(v1_models=lambda _: (status, body)) as server:
        key.setenv(TEACHERS, f"{url_of(server)};engine=vllm")
        shown = []
        for argv in (["doctor", "--json"], ["doctor"]):
            main(argv)
            out, err = capsys.readouterr()
            shown += [*json.loads(out)["problems"], err] if "--json" in argv else [out, err]
    text = "\n".join(shown)
    assert "HTTP 401: invalid credentials: Bearer ***" in text, text[-2000:]
    assert not key_pieces(text), [line for line in text.splitlines() if "credentials" in line]
