"""A served teacher with a head, against the stand-in pooling server (in-process, beside the served
lane's real one): the scores at the head's temperature equal float64's softmax over the states the
server sent, the ids given scored too, a sample of no rows among the others; a pooling server
generates nothing (a sample may fill the max model length); a bad reply names its sample; the body
asked is vLLM's binary per-token pooling request; a server that does not pool per token is a
refusal naming what to serve."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl_patches.teachers import (
    ClientSettings,
    ServedTeacher,
    ServedTeacherError,
    ServedTeacherRefusal,
    TeacherBatch,
)
from tests.teachers.local_servers import MAX_MODEL_LEN, url_of, vllm_like
from tests.teachers.test_teacher_step import H, head, pooled_states

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

SETTINGS = ClientSettings(retries=0, deadline_s=10)
K, TAU = 3, 0.7


def pooling(body):
    """vLLM's float32 binary pooling reply; an input holding id 11 gets a NaN at its last decoded position."""
    states = pooled_states(body["input"])
    if 11 in body["input"]:
        states[-2, 0] = float("nan")
    raw = states.numpy().tobytes()
    item = {"index": 0, "embed_dtype": "float32", "endianness": "little", "start": 0, "end": len(raw),
            "shape": [len(body["input"]), H]}
    return 200, (raw, {"metadata": json.dumps({"data": [item]})})


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def server():
    with vllm_like(pooling=pooling) as running:
        yield running


def test_scores_at_the_heads_temperature_equal_float64_over_the_served_states(server):
    sequences = [torch.tensor([5, 9, 2, 7, 1]), torch.tensor([3, 8]), torch.tensor([6, 4, 10, 2])]
    batch = TeacherBatch(sequences, [2, 2, 1])  # the second sample has no response row
    given = [torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.zeros(0, 2, dtype=torch.long),
             torch.tensor([[7, 6], [9, 8], [11, 10]])]
    weight = head().weight.double()
    with ServedTeacher(url_of(server), head=head(), top_k=K, temperature=TAU, client=SETTINGS) as served:
        scores = served.score(batch, ids=given)
    for i, (ids, start) in enumerate(zip(sequences, batch.response_starts)):
        states = pooled_states(ids.tolist())[start - 1:len(ids) - 1]
        assert torch.equal(scores.hidden_states[i], states)  # row r: the state before token start + r
        logp = torch.log_softmax(states.double() @ weight.T / TAU, dim=1)
        top = logp.topk(K, dim=1)
        close(scores.token_log_probs[i], logp.gather(1, ids[start:, None])[:, 0])
        assert torch.equal(scores.topk_ids[i], top.indices)
        close(scores.topk_log_probs[i], top.values)
        close(scores.tail_log_probs[i], torch.log1p(-top.values.exp().sum(1)))
        at = logp.gather(1, given[i])
        close(scores.ids_log_probs[i], at)
        close(scores.ids_tail_log_probs[i], torch.log1p(-at.exp().sum(1)))
    assert scores.hidden_states[1].shape == (0, H) and scores.hidden_states[1].dtype == torch.float32
    asked = next(body for path, body in server.bodies if path == "/pooling" and body["input"] == [6, 4, 10, 2])
    assert asked == {"model": "m", "input": [6, 4, 10, 2], "task": "token_embed", "use_activation": False,
                     "encoding_format": "bytes", "embed_dtype": "float32", "endianness": "little",
                     "add_special_tokens": False}


def test_a_sample_may_fill_the_max_model_length_of_a_pooling_server(server):
    full = torch.arange(MAX_MODEL_LEN) % 10
    with ServedTeacher(url_of(server), head=head(), top_k=K, client=SETTINGS) as served:
        scores = served.score(TeacherBatch([full], [MAX_MODEL_LEN - 1]))
        assert scores.token_log_probs[0].shape == (1,)
        with pytest.raises(ServedTeacherRefusal) as caught:
            served.score(TeacherBatch([torch.arange(MAX_MODEL_LEN + 1) % 10], [1]))
    assert str(caught.value) == (f"sample 0 has {MAX_MODEL_LEN + 1} ids, over {url_of(server)}'s max model length "
                                 f"{MAX_MODEL_LEN}: a sequence cannot be split (every row needs its whole prefix); "
                                 f"serve the teacher with --max-model-len >= {MAX_MODEL_LEN + 1}")


def test_a_bad_reply_names_its_sample(server):
    batch = TeacherBatch([torch.tensor([5, 9, 2]), torch.tensor([3, 8, 11, 1])], [1, 1])
    with ServedTeacher(url_of(server), head=head(), top_k=K, client=SETTINGS) as served:
        with pytest.raises(ServedTeacherError, match=r"/pooling \(sample 1\): the hidden state of row 2 \(position 2\) "
                                                     r"is not finite") as caught:
            served.score(batch)
    assert caught.value.sample == 1


@pytest.mark.parametrize(("route", "words"), [
    (None, r"does not serve /pooling \(HTTP 404\): hidden states need vLLM's pooling runner; serve the teacher with "
           r"--runner pooling"),
    (lambda body: (400, {"object": "error", "message": "this pooler does not support task 'token_embed'"}),
     r"does not pool per token \(.*\): serve the teacher with --runner pooling"),
])
def test_a_server_that_does_not_pool_per_token_is_a_refusal_naming_what_to_serve(route, words):
    with vllm_like(**({} if route is None else {"pooling": route})) as other:
        with ServedTeacher(url_of(other), head=head(), top_k=K, client=SETTINGS) as served:
            with pytest.raises(ServedTeacherRefusal, match=words) as caught:
                served.score(TeacherBatch([torch.tensor([5, 9, 2])], [1]))
    assert (caught.value.url, caught.value.sample) == (url_of(other), None)  # at connect: the probe's request
