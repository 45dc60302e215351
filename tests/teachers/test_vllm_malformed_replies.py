"""Malformed replies from a small server answering as vLLM does, each a ServedTeacherError naming
the URL, the sample and the field (never a RecursionError, AttributeError, KeyError, ValueError,
OverflowError or TypeError); reply values taken only as they can be (a negative id, an id written
two ways, ranks contradicting the values: the values decide the order); a redirect refused by name."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers import (
    ClientSettings,
    ServedTeacher,
    ServedTeacherError,
    ServedTeacherRefusal,
    TeacherBatch,
)
from tests.teachers.local_servers import completions, url_of, vllm_like

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

K = 2
IDS = [5, 7, 1]  # one sample, response rows at positions 1 and 2 (ids 7 and 1)
SETTINGS = ClientSettings(retries=0, deadline_s=10)


def reply_with(position_two: object) -> dict:
    """A reply whose position 2 (the sample's last) holds `position_two`."""
    good = {"0": {"logprob": -0.5, "rank": 1}, "1": {"logprob": -1.5, "rank": 2}}
    return {"choices": [{"prompt_logprobs": [None, dict(good, **{"7": {"logprob": -9.0, "rank": 40}}),
                                             position_two]}]}


def for_samples(answer):
    """A /v1/completions route: the check's two-id probe answered well, the sample with `answer`."""
    return lambda body: completions(body) if len(body["prompt"]) <= 2 else (200, answer)


def scored(**routes):
    """The sample scored by a server answering with `routes`."""
    with vllm_like(**routes) as server, ServedTeacher(url_of(server), top_k=K, client=SETTINGS) as teacher:
        return teacher.score(TeacherBatch([torch.tensor(IDS)], [1]))


SECOND = {"1": {"logprob": -1.5, "rank": 2}}  # a well-formed second item beside the one under test
BAD_ROWS = [
    ({"0": {"logprob": -0.5}, **SECOND}, r"prompt_logprobs\[2\]\['0'\]\.rank is no rank"),
    ({"0": {"rank": 1}, **SECOND}, r"\['0'\]\.logprob is no number \(got None\)"),
    ({"0": {"logprob": "-0.5", "rank": 1}, **SECOND}, r"\.logprob is no number \(got '-0.5'"),
    ({"0": {"logprob": -0.5, "rank": 1.0}, **SECOND}, r"\.rank is no rank, an int >= 1 \(got 1.0"),
    ({"0": -0.5, **SECOND}, r"\['0'\] is no object with logprob and rank \(got float\)"),
    ({"abc": {"logprob": -0.5, "rank": 1}, **SECOND}, r"key 'abc' is no token id"),
    ({"-3": {"logprob": -0.5, "rank": 1}, **SECOND}, r"key '-3' is a negative id"),
    ({"01": {"logprob": -0.5, "rank": 1}, **SECOND}, r"key '01' is no token id written plainly"),
    ({"99999999999999999999": {"logprob": -0.5, "rank": 1}, **SECOND}, r"is past int64"),
]


@pytest.mark.parametrize(("row", "words"), BAD_ROWS)
def test_a_malformed_row_names_url_sample_and_field(row, words):
    with pytest.raises(ServedTeacherError, match=rf"/v1/completions \(sample 0\): the reply's .*{words}") as caught:
        scored(v1_completions=for_samples(reply_with(row)))
    assert str(caught.value).startswith(f"{caught.value.url}/v1/completions") and caught.value.sample == 0


def test_a_deeply_nested_reply_is_named():
    deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(ServedTeacherError, match=r"\(sample 0\): the reply nests deeper") as caught:
        scored(v1_completions=for_samples(deep))
    assert caught.value.sample == 0 and caught.value.url and str(caught.value).startswith(caught.value.url)


@pytest.mark.parametrize(("cards", "words"), [
    (["m"], r"the reply's data\[0\] is no model card with a str id \(got 'm'\)"),
    ([{"id": 3, "max_model_len": 64}], r"the reply's data\[0\] is no model card with a str id \(got \{'id': 3"),
])
def test_a_model_card_that_is_no_object_is_named(cards, words):
    with pytest.raises(ServedTeacherError, match=rf"/v1/models: {words}") as caught:
        scored(v1_models=lambda _: (200, {"data": cards}))
    assert caught.value.sample is None


def test_values_decide_the_order_when_ranks_contradict_them():
    row = {"0": {"logprob": -1.5, "rank": 1}, "1": {"logprob": -0.5, "rank": 2}}  # the ranks say 0 first
    scores = scored(v1_completions=for_samples(reply_with(row)))
    assert scores.topk_ids[0][1].tolist() == [1, 0]
    assert scores.topk_log_probs[0][1].tolist() == [-0.5, -1.5]
    assert scores.token_log_probs[0].tolist() == [-9.0, -0.5]  # each row's own id (7, then 1)


def test_a_redirect_is_refused_by_name():
    moved = {"location": "http://user:pw1@elsewhere:1/v1/models"}
    with pytest.raises(ServedTeacherRefusal, match=r"/v1/models: the server redirects \(HTTP 302 to "
                                                   r"'http://\*\*\*@elsewhere:1/v1/models'\)") as caught:
        scored(v1_models=lambda _: (302, moved))
    assert "pw1" not in str(caught.value)
    with pytest.raises(ServedTeacherRefusal, match=r"redirects \(HTTP 307 to 'nowhere named'\)"):
        scored(v1_models=lambda _: (307, {}))


def test_several_models_or_an_unserved_name_is_refused_naming_the_url():
    two = {"data": [{"id": "a", "max_model_len": 64}, {"id": "b", "max_model_len": 64}]}
    with vllm_like(v1_models=lambda _: (200, two)) as server:
        url = url_of(server)
        several = rf"^{url} serves 2 models \['a', 'b'\]: name one with ServedTeacher\(model=\.\.\.\)$"
        for model, words in ((None, several), ("c", rf"^{url} does not serve model='c': it serves \['a', 'b'\]$")):
            with ServedTeacher(url, top_k=K, model=model, client=SETTINGS) as teacher, \
                    pytest.raises(ServedTeacherRefusal, match=words) as caught:
                teacher.check()
            assert caught.value.url == url and caught.value.sample is None


def test_the_engines_refusals_say_what_to_do():
    """vLLM's --max-logprobs 400 (top_k over it), a pooling server's 404 on /v1/completions, and
    logits for log-probs: each names the URL and the fix; the request asks temperature 1 of raw
    log-probs (vLLM scores prompt log-probs so), ids not detokenized."""
    bodies = []

    def over_max(body):
        bodies.append(body)
        return 400, {"object": "error", "message": "Requested prompt logprobs of 2, which is greater than max "
                                                   "allowed: 1"}

    over = r"^top_k=2 is over the server's --max-logprobs 1 at {}: ask for top_k <= 1, or serve the teacher with " \
           r"--max-logprobs 2$"
    with vllm_like(v1_completions=over_max) as server, \
            ServedTeacher(url_of(server), top_k=K, client=SETTINGS) as teacher:
        with pytest.raises(ServedTeacherRefusal, match=over.format(url_of(server))):
            teacher.check()
    assert bodies[0]["temperature"] == 1.0 and bodies[0]["detokenize"] is False
    with vllm_like(v1_completions=lambda _: (404, {"detail": "Not Found"})) as server, \
            ServedTeacher(url_of(server), top_k=K, client=SETTINGS) as teacher:
        with pytest.raises(ServedTeacherRefusal, match=r"does not serve /v1/completions \(HTTP 404\): a pooling "
                                                       r"server \(--runner pooling\)") as caught:
            teacher.check()
        assert caught.value.url == url_of(server)
    logits = {"0": {"logprob": 3.5, "rank": 1}, "1": {"logprob": 2.5, "rank": 2}}
    with pytest.raises(ServedTeacherError, match=r"are no log-probabilities .*--logprobs-mode raw_logprobs") as caught:
        scored(v1_completions=for_samples(reply_with(logits)))
    assert caught.value.url and str(caught.value).startswith(caught.value.url) and caught.value.sample == 0
