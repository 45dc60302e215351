"""examples/serve_teacher_groups.py (issue 110 item 10: the only CPU client sent prompts under one KV
block, so serve-teacher's sharing could not be seen) against the lane's serve-teacher (`ours`, blocks
of 32) and its stock vLLM server (`served`), as docs/distillation.md runs it: prompts of 96 tokens
(three blocks), groups of 8 with responses of 24. Each group's prompt tokens, read from the server's
own `/metrics`, are P + G·R = 288 on serve-teacher and G·(P + R) = 960 on the stock server, every
sample scored (R rows each), and the lines say so. Cheap: three groups of one example, in process."""
from __future__ import annotations

import pytest
from kit.examples import load_example

P, R, G = 96, 24, 8


@pytest.fixture(scope="module")
def example():
    return load_example("serve_teacher_groups")


def test_serve_teacher_computes_each_groups_prompt_once_and_the_example_says_so(example, ours, capsys):
    groups = example.main(["--url", ours.url, "--groups", "2", "--seed", "110"])
    assert [g["computed"] for g in groups] == [P + G * R] * 2
    assert all(g["rows"] == [R] * G for g in groups)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"{ours.url}: serve-teacher, KV blocks of 32 tokens", printed
    assert printed[1:] == [f"group {i}: {G} samples, a prompt of {P} tokens, responses of {R}: computed 288 prompt "
                           f"tokens, 960 each sample whole (3.3x fewer; once is 288)" for i in (1, 2)], printed


def test_a_stock_server_computes_each_sample_whole(example, served, capsys):
    groups = example.main(["--url", served.url, "--groups", "1", "--seed", "111"])
    assert [g["computed"] for g in groups] == [G * (P + R)]
    assert "a stock vLLM server (each sample computed whole)" in capsys.readouterr().out
