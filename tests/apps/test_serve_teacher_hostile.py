"""`serve-teacher`'s bodies as a careless or hostile client sends them (issue 105 items 1 and 5),
without vLLM: every request the engine would never run is a `BadRequest` (HTTP 400) naming the
body or the field — a body nested past the recursion limit, an integer past the digits Python reads,
`prompt_logprobs` over the vocabulary under `--max-logprobs -1` (vLLM's own words, which the client
reads the limit from), a model named by no str — never an error the app answers as its engine
failing (a 500 the client retries and fails over on). The app over a stand-in engine and real vLLM:
tests/teachers/lane/test_served_serve_teacher_routes.py, test_served_serve_teacher_vllm.py."""
from __future__ import annotations

import json
import re
import sys

import pytest

from megatron_rl_patches.apps.serve_teacher import bodies

VOCAB = 10
DEEP = b"[" * 200_000 + b"]" * 200_000


@pytest.mark.parametrize("raw", [DEEP, b'{"prompt": ' + DEEP + b"}"], ids=["body", "field"])
def test_a_body_nested_past_the_recursion_limit_is_a_bad_request_naming_the_body(raw):
    with pytest.raises(bodies.BadRequest, match=r"^the body nests deeper than Python's recursion limit \(\d+\)"):
        bodies.read_body(raw)


@pytest.mark.parametrize(("raw", "words"), [(b"{not json", "the body is not JSON (JSONDecodeError: "),
                                            (b"\xff\xfe{", "the body is unreadable as text"),
                                            (b"", "the body is not JSON")])
def test_a_body_that_is_no_json_is_a_bad_request_naming_the_body(raw, words):
    with pytest.raises(bodies.BadRequest, match=re.escape(words)):
        bodies.read_body(raw)


def test_a_good_body_reads_as_json_reads_it():
    body = {"prompt": [1, 2, 3], "prompt_logprobs": 4, "response_start": 2, "model": "m", "x": [1.5, None]}
    assert bodies.read_body(json.dumps(body).encode()) == body


LONG = "9" * 5000


def with_long(template: str) -> str:
    """`template` with its '@' written as the 5,000-digit integer."""
    return template.replace("@", LONG)


@pytest.mark.parametrize(("text", "field"), [
    ('{"prompt": [1, @, 2], "prompt_logprobs": 1}', "prompt[1]"),
    ('{"prompt": [1, 2], "prompt_logprobs": @}', "prompt_logprobs"),
    ('{"prompt": [1, 2], "prompt_logprobs": -@}', "prompt_logprobs"),
    ('{"prompt": [1, 2, 3], "prompt_logprobs": 1, "response_start": @}', "response_start")])
def test_an_integer_past_the_digits_python_reads_is_refused_naming_its_field_and_the_limit(text, field):
    limit = sys.get_int_max_str_digits()
    body = bodies.read_body(with_long(text).encode())
    with pytest.raises(bodies.BadRequest, match=re.escape(
            f"{field} is an integer of 5,000 digits, past the {limit:,} digits a JSON integer may have here")):
        bodies.completion(body, VOCAB, 8, 20)


def test_an_input_integer_past_the_digits_is_refused_by_the_pooling_route_too():
    body = bodies.read_body(with_long('{"input": [@]}').encode())
    with pytest.raises(bodies.BadRequest, match=re.escape("input[0] is an integer of 5,000 digits")):
        bodies.pooling(body, VOCAB, 8)


@pytest.mark.parametrize("k", [VOCAB + 1, 10**9, 2**63])
def test_prompt_logprobs_over_the_vocabulary_under_no_limit_is_refused_in_vllms_words(k):
    """`--max-logprobs -1`: vLLM's limit is the vocabulary (its server answers 400 "greater than max
    allowed: V"); the rows' top-k over V had raised in the engine's answer (a 500)."""
    with pytest.raises(bodies.BadRequest, match=re.escape(
            f"Requested prompt logprobs of {k}, which is greater than max allowed: {VOCAB}")):
        bodies.completion({"prompt": [1, 2], "prompt_logprobs": k}, VOCAB, 8, -1)
    assert bodies.completion({"prompt": [1, 2], "prompt_logprobs": VOCAB}, VOCAB, 8, -1).top_k == VOCAB
    with pytest.raises(bodies.BadRequest, match="greater than max allowed: 20"):
        bodies.completion({"prompt": [1, 2], "prompt_logprobs": k + 20}, VOCAB * 100, 8, 20)


def test_a_limit_over_the_vocabulary_is_the_vocabulary():
    with pytest.raises(bodies.BadRequest, match=re.escape(
            f"Requested prompt logprobs of {VOCAB + 1}, which is greater than max allowed: {VOCAB}")):
        bodies.completion({"prompt": [1, 2], "prompt_logprobs": VOCAB + 1}, VOCAB, 8, 5000)


@pytest.mark.parametrize("model", [3, ["m"], {"a": 1}, True])
def test_a_model_named_by_no_str_is_a_bad_request(model):
    body = {"prompt": [1, 2], "prompt_logprobs": 1, "model": model}
    with pytest.raises(bodies.BadRequest, match=r"^model must be the served model's name \(a str\), got a "):
        bodies.served_model_named(body, "m")
    assert bodies.served_model_named({"model": "m"}, "m") is None
    assert bodies.served_model_named({}, "m") is None
    with pytest.raises(LookupError, match=r"^The model `other` does not exist\.$"):
        bodies.served_model_named({"model": "other"}, "m")
    with pytest.raises(LookupError, match=r"^The model `x{60}…` does not exist\.$"):
        bodies.served_model_named({"model": "x" * 5000}, "m")
