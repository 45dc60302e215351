"""`doctor` checks a served teacher's `;head=DIR` entry without reading the head's weights: DIR's
config.json and head tensor are found (a missing one is a problem naming the directory), the
head is planned on the meta device (its vocabulary and hidden size, the dtype its states travel
in), and the server is asked in bounded time. (Against a real pooling server: the served lane.)"""
from __future__ import annotations

import json
import time

from megatron_rl_patches.apps import cli
from megatron_rl_patches.teachers.kinds.served_entry import planned_head
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

TEACHERS = "MEGATRON_RL_PATCHES_OPD_TEACHERS"


def teacher_problems(out: str) -> list[str]:
    return [p for p in json.loads(out)["problems"] if p.startswith(TEACHERS)]


def test_doctor_names_a_head_directory_without_its_config(cli_run, monkeypatch, tmp_path):
    monkeypatch.setenv(TEACHERS, f"http://127.0.0.1:9;engine=vllm;head={tmp_path / 'absent'}")
    start = time.monotonic()
    code, out, _ = cli_run("doctor", "--json")
    problems = teacher_problems(out)
    assert code == cli.PROBLEM and len(problems) == 1, problems
    assert problems[0].startswith(f"{TEACHERS}: served teacher 'http://127.0.0.1:9' (vllm, k=16) fails its check"), \
        problems
    assert str(tmp_path / "absent") in problems[0], problems
    assert time.monotonic() - start < 30


def test_the_head_is_planned_without_its_weights_then_the_server_asked(cli_run, monkeypatch, tmp_path):
    write_tiny_checkpoint(tmp_path / "teacher", tiny_hf_config("qwen3"), seed=1)
    head = planned_head(str(tmp_path / "teacher"))
    assert head.weight.device.type == "meta" and (head.vocab_size, head.hidden_size) == (1001, 32)
    monkeypatch.setenv(TEACHERS, f"http://127.0.0.1:9;engine=vllm;head={tmp_path / 'teacher'}")
    code, out, _ = cli_run("doctor", "--json")
    (problem,) = teacher_problems(out)
    assert code == cli.PROBLEM and "config.json" not in problem and "127.0.0.1:9" in problem, problem


def test_a_head_with_another_tokenizer_is_checked_not_refused(cli_run, monkeypatch, tmp_path):
    """`;tokenizer=DIR;head=DIR` (exact buckets through the head): the tokenizer it names looked
    for and the server asked, the entry itself no problem."""
    write_tiny_checkpoint(tmp_path / "teacher", tiny_hf_config("qwen3"), seed=1)
    monkeypatch.setenv(TEACHERS, f"http://127.0.0.1:9;engine=vllm;tokenizer={tmp_path / 'absent'};"
                                 f"head={tmp_path / 'teacher'}")
    code, out, _ = cli_run("doctor", "--json")
    problems = teacher_problems(out)
    assert code == cli.PROBLEM and len(problems) == 2, problems
    assert "neither a tokenizer.json nor a directory holding one" in problems[0], problems
    assert "served teacher 'http://127.0.0.1:9' (vllm, k=16) fails its check" in problems[1], problems
