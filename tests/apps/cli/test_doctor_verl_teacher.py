"""`doctor` checks verl's served teacher (MEGATRON_RL_PATCHES_VERL_TEACHER) as it checks slime's:
every replica asked on its own, then all of them as one teacher, each line naming verl's variable
(a new user's `'http://dead|http://live;engine=vllm'` was "no problems found"); an entry verl's own
parser refuses is a problem; the live self-teacher (`student;context=KEY`) names no server."""
from __future__ import annotations

import json

import pytest
from kit.ports import refused_port

from megatron_rl_patches.apps import cli
from tests.teachers.local_servers import MODEL, completions, url_of, vllm_like

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

VERL = "MEGATRON_RL_PATCHES_VERL_TEACHER"


def card(root: str):
    def models(_):
        return 200, {"object": "list", "data": [{"id": MODEL, "root": root, "max_model_len": 64}]}
    return models


def report(cli_run) -> tuple[int, list[str], list[str]]:
    """(exit code, the problems, the lines saying what was checked) of `doctor --json`."""
    code, out, _ = cli_run("doctor", "--json")
    found = json.loads(out)
    return code, found["problems"], found["environment"]["teachers_checked"]


def test_a_dead_replica_of_verls_teacher_is_a_problem_naming_it(cli_run, monkeypatch):
    # the dead replica a port held and refusing (a server stopped first could hand its port to the live one)
    with refused_port() as port, vllm_like() as live:
        dead = f"http://127.0.0.1:{port}"
        monkeypatch.setenv(VERL, f"{dead}|{url_of(live)};engine=vllm")
        code, problems, checked = report(cli_run)
        text = cli_run("doctor")[1]
    mine = [p for p in problems if p.startswith(f"{VERL}: ")]
    assert code == cli.PROBLEM and len(mine) == 1, problems
    assert f"served teacher '{dead}|{url_of(live)}' replica '{dead}'" in mine[0] and "fails its check" in mine[0]
    assert checked == [] and "no problems found" not in text and f"  - {VERL}: served teacher" in text


def other_weights(body):
    """Another checkpoint's scores: replicas are one teacher by what they compute (issue 86 item 1)."""
    status, reply = completions(body)
    for entry in reply["choices"][0]["prompt_logprobs"][1:]:
        for item in entry.values():
            item["logprob"] -= 0.5
    return status, reply


def test_verls_replicas_are_checked_each_then_as_one_teacher(cli_run, monkeypatch):
    with vllm_like(v1_models=card("/ckpt/m")) as a, vllm_like(v1_models=card("/ckpt/copy")) as b, \
            vllm_like(v1_models=card("/ckpt/m"), v1_completions=other_weights) as other:
        monkeypatch.setenv(VERL, f"{url_of(a)}|{url_of(b)};engine=vllm")
        code, problems, checked = report(cli_run)
        monkeypatch.setenv(VERL, f"{url_of(a)}|{url_of(other)};engine=vllm")
        _, differing, _ = report(cli_run)
        asked = a.answered("/v1/models"), b.answered("/v1/models")
    assert [p for p in problems if VERL in p] == [] and len(checked) == 3, (problems, checked)
    assert all(line.startswith(f"{VERL}: served teacher '{url_of(a)}|{url_of(b)}'") for line in checked), checked
    assert [f"replica '{url_of(a)}'" in checked[0], f"replica '{url_of(b)}'" in checked[1]] == [True, True]
    assert "(its 2 replicas as one teacher) (vllm; verl's K checked when verl first asks): answers" in checked[2]
    assert min(asked) >= 2  # each replica on its own, then again as one teacher
    (problem,) = [p for p in differing if VERL in p]
    assert "(its 2 replicas as one teacher)" in problem, problem
    assert f"replica {url_of(other)} scores the probe other" in problem, problem


@pytest.mark.parametrize(("entry", "words"), [
    ("http://127.0.0.1:9", "name the engine serving it"),
    ("http://127.0.0.1:9;engine=vllm;bogus=1", "unknown option 'bogus=1'"),
    ("student;tokenizer=/ckpt/student", "needs a privileged context"),
])
def test_an_entry_verl_refuses_is_a_problem_naming_the_variable(cli_run, monkeypatch, entry, words):
    monkeypatch.setenv(VERL, entry)
    code, problems, _ = report(cli_run)
    mine = [p for p in problems if p.startswith(f"{VERL}=")]
    assert code == cli.PROBLEM and len(mine) == 1 and words in mine[0], problems


def test_the_live_self_teacher_names_no_server_to_ask(cli_run, monkeypatch):
    monkeypatch.setenv(VERL, "student;context=solution;tokenizer=/ckpt/student")
    _, problems, checked = report(cli_run)
    assert [p for p in problems if VERL in p] == [] and checked == []


def test_a_password_in_verls_url_is_one_problem_and_never_shown(cli_run, monkeypatch):
    monkeypatch.setenv(VERL, "http://bob:s3cret@127.0.0.1:9|http://127.0.0.1:9;engine=vllm")
    code, out, err = cli_run("doctor", "--json")
    mine = [p for p in json.loads(out)["problems"] if VERL in p]
    assert code == cli.PROBLEM and len(mine) == 1 and "user or password" in mine[0], mine
    assert "s3cret" not in out + err
