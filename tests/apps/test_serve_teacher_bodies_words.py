"""`serve-teacher`'s request bodies read in memory (`apps/serve_teacher/bodies.py`), each refusal
matched whole and each bound at its edge: what the mutation run of issue 105 item 10 found unchecked
by test_serve_teacher_shaping.py and test_serve_teacher_hostile.py (docs/testing.md, its row)."""
from __future__ import annotations

import re

import pytest

from megatron_rl_patches.apps.serve_teacher import bodies

VOCAB, LONGEST = 10, 4


def refused(call, *args) -> str:
    with pytest.raises(bodies.BadRequest) as caught:
        call(*args)
    return str(caught.value)


def test_the_served_models_name_is_shown_whole_up_to_60_characters_and_its_kind_named():
    assert refused(bodies.served_model_named, {"model": 3}, "m") == \
        "model must be the served model's name (a str), got a int"
    for length, shown in ((60, "x" * 60), (61, "x" * 60 + "…")):
        with pytest.raises(LookupError, match=re.escape(f"The model `{shown}` does not exist.")):
            bodies.served_model_named({"model": "x" * length}, "m")


@pytest.mark.parametrize("ids", [[], 5, "1 2", [1.5], [1, True], [True], None, {"a": 1}])
def test_ids_that_are_no_non_empty_list_of_ints_are_refused_whole(ids):
    assert refused(bodies.token_ids, ids, "prompt", VOCAB, LONGEST) == \
        "prompt must be a non-empty list of token ids (this server takes token ids, not text)"


def test_a_sample_of_the_max_model_len_is_taken_and_one_more_refused_whole():
    assert bodies.token_ids([1] * LONGEST, "input", VOCAB, LONGEST) == [1] * LONGEST
    assert refused(bodies.token_ids, [1] * (LONGEST + 1), "input", VOCAB, LONGEST) == (
        f"This model's maximum context length is {LONGEST} tokens. However, your request has {LONGEST + 1} input "
        "tokens: a sample and its shared prefix must fit --max-model-len")


def test_a_response_start_out_of_range_is_refused_whole_naming_the_last_it_takes():
    assert refused(bodies.response_start, {"response_start": 5}, 5) == (
        "response_start must be an int from 1 to the prompt's length - 1 (4), the first response id's position, "
        "got 5")


def test_a_limit_of_zero_takes_no_top_k():
    assert bodies.logprobs_limit(0, VOCAB) == 0 and bodies.logprobs_limit(-1, VOCAB) == VOCAB
    assert bodies.logprobs_limit(3, VOCAB) == 3 and bodies.logprobs_limit(VOCAB + 5, VOCAB) == VOCAB
    assert refused(bodies.completion, {"prompt": [1, 2], "prompt_logprobs": 1}, VOCAB, LONGEST, 0) == \
        "Requested prompt logprobs of 1, which is greater than max allowed: 0"


@pytest.mark.parametrize("read", [bodies.completion, bodies.pooling])
def test_a_body_that_is_no_object_is_refused_whole(read):
    args = (VOCAB, LONGEST, 20) if read is bodies.completion else (VOCAB, LONGEST)
    assert refused(read, [1, 2], *args) == "the body must be a JSON object"


def test_the_completion_refusals_are_said_whole():
    assert refused(bodies.completion, {"prompt": [1], "prompt_logprobs": 1, "stream": True}, VOCAB, LONGEST, 20) == \
        "prompt_logprobs are not available when stream is enabled"
    assert refused(bodies.completion, {"prompt": [1], "prompt_logprobs": -1}, VOCAB, LONGEST, 20) == (
        "this server answers prompt log-probs only: prompt_logprobs must be an int >= 0 (the top-k per position)")


def test_the_pooling_refusals_are_said_whole_and_the_defaults_taken():
    asked = bodies.pooling({"input": [1, 2]}, VOCAB, LONGEST)  # every field left out: vLLM's defaults
    assert (asked.ids, asked.start, asked.encoding, asked.embed_dtype) == ([1, 2], None, "float", "float32")
    assert bodies.pooling({"input": [1], "encoding_format": "float", "endianness": "native"}, VOCAB,
                          LONGEST).encoding == "float"
    assert refused(bodies.pooling, {"input": [1], "task": "embed"}, VOCAB, LONGEST) == \
        "this server pools per token only (task 'token_embed'), not task 'embed'"
    for field in ("use_activation", "normalize"):
        assert refused(bodies.pooling, {"input": [1], field: True}, VOCAB, LONGEST) == \
            "this server sends the final hidden states as they are: use_activation must be false"
    assert refused(bodies.pooling, {"input": [1], "endianness": "big"}, VOCAB, LONGEST) == \
        "this server sends little-endian values only: endianness must be 'little' or 'native'"
