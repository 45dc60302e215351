"""Issue 96 items 3 and 6: what slime refuses at start is refused up front. A bad
MEGATRON_RL_PATCHES_OPD_SCORE_AT (read by slime's rollout manager) is named by `check_settings`, the
launcher (`run`) and `doctor`, with or without the teachers set and under K=vocab too, quoting no
URL's password and no more than a bounded piece of the value; a served top-k teacher without
MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher (refused by the actor before anything loads) is named by the
same checks, beside what doctor finds of its server."""
from __future__ import annotations

import json

import pytest

from megatron_rl_patches.apps import cli
from megatron_rl_patches.integrations import check_settings
from megatron_rl_patches.patching.startup.launcher import launch_environment

TEACHERS = "MEGATRON_RL_PATCHES_OPD_TEACHERS"
SCORE_AT = "MEGATRON_RL_PATCHES_OPD_SCORE_AT"
IDS_FROM = "MEGATRON_RL_PATCHES_OPD_IDS_FROM"
K = "MEGATRON_RL_PATCHES_OPD_K"
SERVED = {TEACHERS: "http://127.0.0.1:9;engine=vllm", IDS_FROM: "teacher"}
REFUSAL = rf"{SCORE_AT}='(rolout|both)': use rollout \(each sample scored as its generation ends\) or train"

SETTINGS = {
    "alone": {SCORE_AT: "both"},  # the rollout manager's environment may hold it without the teachers
    "served": {**SERVED, SCORE_AT: "rolout"},
    "k_vocab": {TEACHERS: "http://127.0.0.1:9;engine=vllm;head=/nonexistent/head", K: "vocab", SCORE_AT: "rolout"},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_check_settings_and_run_refuse_a_bad_score_at(name):
    with pytest.raises(ValueError, match=REFUSAL):
        check_settings(SETTINGS[name])
    with pytest.raises(ValueError, match=REFUSAL):
        launch_environment(None, SETTINGS[name])  # `megatron-rl-patches run -- ...`: nothing started


@pytest.mark.parametrize("name", list(SETTINGS))
def test_doctor_names_a_bad_score_at(cli_run, monkeypatch, name):
    for variable, value in SETTINGS[name].items():
        monkeypatch.setenv(variable, value)
    code, out, _ = cli_run("doctor", "--json")
    problems = json.loads(out)["problems"]
    assert code == cli.PROBLEM and [p for p in problems if p.startswith(f"{SCORE_AT}=")], problems


@pytest.mark.parametrize("place", ["rollout", "train", " Rollout ", ""])
def test_each_place_passes(place):
    check_settings({**SERVED, SCORE_AT: place})
    check_settings({SCORE_AT: place})


def test_the_refusal_quotes_no_password_and_a_bounded_piece():
    value = "http://bob:hunter2@teacher:8000;engine=vllm" + "x" * 1_000_000
    with pytest.raises(ValueError, match=SCORE_AT) as refused:
        check_settings({**SERVED, SCORE_AT: value})
    message = str(refused.value)
    assert "hunter2" not in message and "bob" not in message and "***@teacher" in message, message
    assert len(message) < 400 and "characters)" in message, len(message)


def test_a_served_top_k_teacher_without_its_ids_is_refused_up_front_and_by_doctor(cli_run, monkeypatch):
    said = rf"{TEACHERS} entry 'http://127.0.0.1:9' with {IDS_FROM}=student: a served engine scores its own top-k"
    with pytest.raises(ValueError, match=said):
        check_settings({TEACHERS: SERVED[TEACHERS]})
    with pytest.raises(ValueError, match=said):
        launch_environment(None, {TEACHERS: SERVED[TEACHERS]})
    check_settings(SERVED)
    monkeypatch.setenv(TEACHERS, SERVED[TEACHERS])
    code, out, _ = cli_run("doctor", "--json")
    problems = json.loads(out)["problems"]
    assert code == cli.PROBLEM and any(p.startswith(f"{TEACHERS} entry 'http://127.0.0.1:9' with {IDS_FROM}=student")
                                       for p in problems), problems
    # its server is still asked (nothing listens at port 9): both problems named, not only the first
    assert any("served teacher 'http://127.0.0.1:9' (vllm, k=16) fails its check" in p for p in problems), problems
