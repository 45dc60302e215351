"""`doctor` checks a served teacher's entry by asking its server (`ServedTeacher.check`), without
loading anything: nothing listening is a problem naming the URL within seconds, the URL is never
reported as a missing path, and a user or password written in it is never printed."""
from __future__ import annotations

import json
import time

from kit.ports import refused_port

from megatron_rl_patches.apps import cli

TEACHERS = "MEGATRON_RL_PATCHES_OPD_TEACHERS"
IDS_FROM = "MEGATRON_RL_PATCHES_OPD_IDS_FROM"  # =teacher: a served top-k teacher's buckets (else refused first)


def teacher_problems(out: str) -> list[str]:
    return [p for p in json.loads(out)["problems"] if p.startswith(TEACHERS)]


def test_doctor_names_a_served_teacher_nothing_answers_in_bounded_time(cli_run, monkeypatch):
    with refused_port() as port:  # held: nothing can take it and answer
        url = f"http://127.0.0.1:{port}"
        monkeypatch.setenv(TEACHERS, f"{url};engine=vllm,/nonexistent")
        monkeypatch.setenv(IDS_FROM, "teacher")
        start = time.monotonic()
        code, out, _ = cli_run("doctor", "--json")
        elapsed = time.monotonic() - start
    problems = teacher_problems(out)
    assert code == cli.PROBLEM and len(problems) == 2, problems
    assert problems[0].startswith(f"{TEACHERS}: served teacher '{url}' (vllm, k=16) fails its check"), problems
    assert "does not exist" not in problems[0] and "teacher '/nonexistent' does not exist" in problems[1]
    assert elapsed < 30, elapsed  # refused at once; the doctor's own deadline is 15 s


def test_doctor_never_prints_a_password_written_in_a_served_url(cli_run, monkeypatch):
    monkeypatch.setenv(TEACHERS, "http://alice:s3cret@127.0.0.1:9;engine=vllm")
    for argv in (("doctor", "--json"), ("doctor",)):
        code, out, err = cli_run(*argv)
        assert code == cli.PROBLEM and "s3cret" not in out + err, out
        assert "user or password" in out and "***@127.0.0.1:9" in out


def test_doctor_says_whether_the_api_key_is_set_never_its_value(cli_run, monkeypatch):
    from megatron_rl_patches.apps.cli import doctor

    monkeypatch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", "k3y-value")
    for argv in (("doctor", "--json"), ("doctor",)):
        _, out, err = cli_run(*argv)
        assert "k3y-value" not in out + err and doctor.KEY_SET in out
