"""A real sglang-router 0.3.2 in front of the lane's real vLLM servers (the generate one and the
pooling one). What it passes decides what a served teacher can ask through it: it answers
`/v1/models` with its own card (no `max_model_len`), refuses a prompt of token ids on
`/v1/completions` (422: it reads `prompt` as text) and has no `/pooling` nor `/tokenize` (404).
So neither of the package's vLLM routes passes: the teacher's refusal (and `doctor`'s line) names
the router and says what to give instead (the replicas' own URLs joined by '|'). The first test
pins the router's behaviour itself, so a release that passes these routes shows here."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from megatron_rl_patches.apps.cli import doctor
from megatron_rl_patches.teachers import ServedTeacher
from megatron_rl_patches.teachers.errors import ServedTeacherError
from tests.teachers.lane.served_kit import API_KEY, VLLM_PYTHON

TEACHERS = "MEGATRON_RL_PATCHES_OPD_TEACHERS"


def router_program() -> Path:
    program = Path(VLLM_PYTHON).parent / "sglang-router"
    if not program.exists():
        pytest.fail(f"the served lane installs sglang-router 0.3.2 beside vLLM (tools/router-lane.txt): no {program}")
    return program


@pytest.fixture(scope="module")
def router(served, pooled, tmp_path_factory):
    from megatron_rl_patches.testing.sglang_router import sglang_router

    log = tmp_path_factory.mktemp("router") / "router.log"
    with sglang_router(router_program(), [served.url, pooled.url], log) as ready:
        yield ready.url


def post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json",
                                                                      "authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def test_what_the_router_passes(router, served):
    with urllib.request.urlopen(router + "/v1/models", timeout=30) as reply:
        cards = json.loads(reply.read())["data"]
    assert [card.get("max_model_len") for card in cards] == [None], cards
    status, text = post(router + "/v1/completions", {"model": str(served.directory), "prompt": [1, 2, 3],
                                                      "max_tokens": 1, "prompt_logprobs": 2})
    assert status == 422 and "StringOrArray" in text, (status, text)
    assert post(router + "/pooling", {"model": str(served.directory), "input": [1, 2, 3]})[0] == 404
    assert post(router + "/tokenize", {"model": str(served.directory), "prompt": "t1"})[0] == 404
    # the same requests straight to the engine are answered (the router, not the body, refuses them)
    assert post(served.url + "/v1/completions", {"model": str(served.directory), "prompt": [1, 2, 3],
                                                 "max_tokens": 1, "prompt_logprobs": 2})[0] == 200


@pytest.mark.parametrize("route", ["top-k", "hidden states"])
def test_the_teacher_behind_the_router_is_refused_naming_it(router, served, route):
    head = {} if route == "top-k" else {"head": str(served.directory)}
    with ServedTeacher(router, engine="vllm", top_k=4, **head) as teacher, \
            pytest.raises(ServedTeacherError) as refused:
        teacher.check()
    said = str(refused.value)
    assert "router in front" in said and "sglang-router 0.3.2" in said, said
    assert "joined by '|'" in said, said


def test_doctor_names_the_router(router, monkeypatch):
    monkeypatch.setenv(TEACHERS, f"{router};engine=vllm")
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_K", "4")
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_IDS_FROM", "teacher")  # a served top-k teacher's buckets (else refused)
    problems = [p for p in doctor.collect()["problems"] if p.startswith(TEACHERS)]
    assert len(problems) == 1 and "router in front" in problems[0], problems
    assert API_KEY not in problems[0], problems
