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


RESULTS: dict = {}


def said_of(case: str):
    return RESULTS[case]


@pytest.fixture(scope="module", autouse=True)
def said():
    # this checkout first (a mutation run's mutated copy, with mutmut after it: docs/testing.md)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([VLLM_PYTHON or sys.executable, "-m", "tests.teachers.lane.serve_teacher_stand_in"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    RESULTS.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return RESULTS


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
    assert said["card-dead"] == [503, {"error": {
        "message": "the teacher's engine is dead: this server is stopping (ask another replica)",
        "type": "ServiceUnavailableError", "param": None, "code": 503}}]
    assert said["health-dead"][0] == 503
    assert said["deaths"][0] == 2  # each told the server to stop


def test_each_error_is_vllms_shape_with_its_kind():
    assert said_of("bad-request-whole") == [400, {"error": {
        "message": "prompt must be a non-empty list of token ids (this server takes token ids, not text)",
        "type": "BadRequestError", "param": None, "code": 400}}]
    assert said_of("other-model") == [404, {"error": {"message": "The model `other` does not exist.",
                                                      "type": "NotFoundError", "param": None, "code": 404}}]
    assert said_of("engine-failed-whole") == [500, {"error": {
        "message": "the teacher's engine failed: RuntimeError: selected index k out of range",
        "type": "InternalServerError", "param": None, "code": 500}}]
    status, body = said_of("own-fault")  # the states the head cannot take: this server's fault after the engine's
    assert status == 500 and body["error"]["type"] == "InternalServerError" and \
        body["error"]["message"].startswith("serve-teacher failed: RuntimeError: "), body


def test_good_requests_answer_the_engines_states_in_vllms_shapes():
    for name in ("completion-None", "completion-3", "pooling-float-None", "pooling-float-3", "pooling-bytes-None",
                 "pooling-bytes-3", "card"):
        assert said_of(name) and all(said_of(name)), name
    assert said_of("tokenize") == [200, {"count": 2, "max_model_len": 64, "tokens": [3, 0], "token_strs": None}]
    assert said_of("tokenize-default")[1]["tokens"] == [4, 1]  # add_special_tokens unless told
    assert said_of("tokenize-no-text") == [400, {"error": {
        "message": "this server tokenizes a text: prompt must be a str", "type": "BadRequestError", "param": None,
        "code": 400}}]
    assert said_of("no-tokenizer") == [400, "Tokenizer not available: the engine was started with "
                                            "--skip-tokenizer-init"]
    assert said_of("health") == [200] and said_of("metrics") == [200] and said_of("no-docs") == [404, 404]
    assert said_of("shut-once") == [1]  # the app's lifespan stops the engine when it ends


def test_every_route_asks_for_the_key():
    keyed = said_of("keyed")
    assert keyed["none"] == keyed["Bearer x"] == [401, {"error": "Unauthorized"}]
    assert keyed["Bearer k"][0] == 200
