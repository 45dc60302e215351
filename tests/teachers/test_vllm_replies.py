"""The vLLM engine's reading of `prompt_logprobs` on replies written here in vLLM's shape (beside
the served lane, which reads a real server's): the actual id outside the top-k or among them, a tie
at the k-th rank, rows best first, and values that are no log-probabilities refused."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacherError
from megatron_rl_patches.teachers.served.engines.vllm import VllmEngine
from megatron_rl_patches.teachers.served.http import TeacherClient

URL = "http://127.0.0.1:9"


def engine(k: int) -> VllmEngine:
    return VllmEngine(TeacherClient(URL, ClientSettings()), k, None)


def entry(*items: tuple[int, float, int]) -> dict:
    return {str(i): {"logprob": value, "rank": rank, "decoded_token": None} for i, value, rank in items}


def reply(*positions) -> dict:
    return {"choices": [{"prompt_logprobs": [None, *positions]}]}


def test_actual_id_outside_and_inside_the_top_k():
    lp = [math.log(p) for p in (0.5, 0.2, 0.1, 0.05)]
    rows = engine(2).parse(reply(entry((7, lp[3], 4), (3, lp[0], 1), (9, lp[1], 2)),  # 7 outside: K+1 entries
                                 entry((4, lp[0], 1), (5, lp[1], 2))),  # 5 inside: K entries
                           [1, 7, 5], 1, 0)
    assert rows.topk_ids.tolist() == [[3, 9], [4, 5]]
    assert rows.token_log_probs.tolist() == [lp[3], lp[1]]
    torch.testing.assert_close(rows.tail_log_probs.exp(), torch.tensor([0.3, 0.3], dtype=torch.float64))


def test_a_tie_at_the_kth_rank_keeps_the_top_k_not_the_actual_id():
    # the actual id 8 ties the 2nd (rank 2 as well) but vLLM's top-k chose 6: K+1 entries
    rows = engine(2).parse(reply(entry((8, -1.5, 2), (2, -1.0, 1), (6, -1.5, 2))), [0, 8], 1, 0)
    assert rows.topk_ids.tolist() == [[2, 6]] and rows.token_log_probs.tolist() == [-1.5]


def test_response_rows_only():
    positions = [entry((i, -0.1, 1)) for i in range(1, 5)]
    rows = engine(1).parse(reply(*positions), [0, 1, 2, 3, 4], 3, 0)
    assert rows.topk_ids.tolist() == [[3], [4]]


def test_logits_instead_of_log_probs_are_refused():
    # --logprobs-mode raw_logits: values above 0
    with pytest.raises(ServedTeacherError, match="no log-probabilities.*--logprobs-mode raw_logprobs"):
        engine(2).parse(reply(entry((3, 2.0, 1), (9, 1.0, 2))), [0, 3], 1, 0)
    # negative control: the same shape as log-probs passes
    engine(2).parse(reply(entry((3, -0.5, 1), (9, -1.5, 2))), [0, 3], 1, 0)


@pytest.mark.parametrize(("body", "words"), [
    ({"choices": []}, "no choices"),
    (reply(), "2 prompt ids but prompt_logprobs of length 1"),
    (reply(entry((1, -0.1, 1))), "position 1 holds no top-2 with the actual id 3"),
])
def test_a_reply_of_another_shape_is_named(body, words):
    with pytest.raises(ServedTeacherError, match=words) as caught:
        engine(2).parse(body, [0, 3], 1, 5)
    assert caught.value.url == URL and caught.value.sample == 5


def test_ranks_other_than_one_to_k_are_sorted_by_rank_then_value():
    rows = engine(2).parse(reply(entry((4, -2.0, 1), (5, -1.0, 1))), [0, 4], 1, 0)  # two "rank 1"
    assert rows.topk_ids.tolist() == [[5, 4]] and rows.topk_log_probs.tolist() == [[-1.0, -2.0]]


def test_replies_are_decoded_with_json_where_orjson_refuses():
    from megatron_rl_patches.teachers.served.http import decode

    assert decode(b'{"logprob": -Infinity}', "", URL, 0) == {"logprob": -math.inf}  # orjson refuses this
    assert decode(b'{"logprob": -1.5}', "", URL, 0) == {"logprob": -1.5}
    with pytest.raises(ServedTeacherError, match="the reply is not JSON"):
        decode(b"<html>bad gateway</html>", "", URL, 3)
