"""`serve-teacher`'s routes over a stand-in engine (issue 105 items 1, 5 and 7), in vLLM's interpreter
(FastAPI is vLLM's; `serve_teacher_stand_in.py`, no vLLM imported, ~3 s): every request the engine
never runs is a 400 naming the body or the field — a body nested 200,000 deep (it had answered 500
"the teacher's engine failed: RecursionError"), an integer of 5,000 digits (400 "the body is no JSON"
before, naming neither field nor limit), `prompt_logprobs` over the vocabulary under `--max-logprobs
-1` (500 "selected index k out of range" before; vLLM's words now) — and nothing reaches the engine;
what the engine raises is a 500 naming it; a dead engine core answers the card 503 as it answers
`/health` (the card had answered 200 until a request reached the engine), and stops the server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.teachers.lane.served_kit import VLLM_PYTHON

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def said():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([VLLM_PYTHON or sys.executable, "-m", "tests.teachers.lane.serve_teacher_stand_in"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("case", "words"), [
    ("deep", "the body nests deeper than Python's recursion limit"),
    ("deep-field", "the body nests deeper than Python's recursion limit"),
    ("no-json", "the body is not JSON (JSONDecodeError"),
    ("no-utf8", "the body is unreadable as text"),
    ("long-id", "prompt[1] is an integer of 5,000 digits, past the 4,300 digits a JSON integer may have here"),
    ("long-k", "prompt_logprobs is an integer of 5,000 digits"),
    ("long-start", "response_start is an integer of 5,000 digits"),
    ("model-int", "model must be the served model's name (a str), got a int"),
    ("k-over-vocab", "Requested prompt logprobs of 17, which is greater than max allowed: 16"),
    ("k-1e9", f"Requested prompt logprobs of {10**9}, which is greater than max allowed: 16"),
    ("k-2**63", f"Requested prompt logprobs of {2**63}, which is greater than max allowed: 16"),
    ("pooling-deep", "the body nests deeper"),
    ("tokenize-deep", "the body nests deeper")])
def test_a_request_the_engine_never_runs_is_a_400_naming_the_body_or_the_field(said, case, words):
    status, message = said[case]
    assert status == 400 and message is not None and message.startswith(words), (case, status, message)


def test_nothing_refused_reaches_the_engine_and_a_vocabulary_of_ids_is_answered(said):
    assert said["k-vocab"][0] == 200
    assert said["asked-so-far"][0] == 1  # the one good request


def test_what_the_engine_raised_is_a_500_naming_it(said):
    assert said["engine-failed"] == [500, "the teacher's engine failed: RuntimeError: selected index k out of range"]
    assert said["deaths-after-failure"][0] == 0  # a live engine's failure does not stop the server


def test_a_dead_engine_core_answers_the_card_as_it_answers_health_and_stops_the_server(said):
    assert said["card-alive"][0] == 200
    assert said["card-dead"] == [503, "the teacher's engine is dead: this server is stopping (ask another replica)"]
    assert said["health-dead"][0] == 503
    assert said["deaths"][0] == 2  # each told the server to stop
