"""A served teacher against a real vLLM server (the session's, tests/teachers/lane/conftest.py):
its scores against transformers' own forward of the same checkpoint, the exact-tail loss through
its buckets against float64, and every refusal in bounded time. The last test stops the server."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from megatron_rl_patches import topk_kl, topk_logprobs
from megatron_rl_patches.teachers import (
    ClientSettings,
    ServedTeacher,
    ServedTeacherError,
    ServedTeacherRefusal,
    TeacherBatch,
)
from megatron_rl_patches.testing.divergence_reference import bucket_loss
from megatron_rl_patches.testing.multirank import run_multirank
from tests.teachers.lane.forwarder import Forwarder
from tests.teachers.lane.served_kit import MAX_LOGPROBS, MAX_MODEL_LEN, VOCAB

K = MAX_LOGPROBS
FAST = ClientSettings(retries=2, backoff_s=0.1, deadline_s=60.0)


def samples(seed: int, lengths: list[int], starts: list[int]) -> TeacherBatch:
    gen = torch.Generator().manual_seed(seed)
    return TeacherBatch([torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths], starts)


def reference_rows(model, ids: torch.Tensor, start: int, dtype: torch.dtype) -> torch.Tensor:
    """transformers' log-softmax of the rows that score ids[start:] ([R, V], in `dtype`)."""
    with torch.no_grad():
        logits = model.to(dtype)(ids[None]).logits[0]
    model.float()
    return torch.log_softmax(logits.to(dtype), dim=-1)[start - 1:-1]


@pytest.fixture(scope="module")
def scored(served):
    url, model = served.url, served.model
    batch = samples(0, [12, 40, 200, 2, 5], [3, 20, 1, 1, 5])
    with ServedTeacher(url, "vllm", top_k=K, client=FAST) as teacher:
        return batch, teacher.score(batch), model


def test_scores_equal_transformers_float32_forward(scored):
    batch, scores, model = scored
    assert len(scores) == len(batch)
    for i, (ids, start) in enumerate(zip(batch.sequences, batch.response_starts)):
        rows = batch.response_rows(i)
        assert scores.topk_ids[i].shape == (rows, K) and scores.topk_log_probs[i].shape == (rows, K)
        assert scores.token_log_probs[i].shape == (rows,) and scores.tail_log_probs[i].shape == (rows,)
        if not rows:
            continue
        ref = reference_rows(model, ids, start, torch.float32).double()
        token = ref.gather(1, ids[start:, None])[:, 0]
        torch.testing.assert_close(scores.token_log_probs[i], token, rtol=0, atol=1e-4)
        torch.testing.assert_close(scores.topk_log_probs[i], ref.gather(1, scores.topk_ids[i]), rtol=0, atol=1e-4)
        # the teacher's own top-k, ties aside: nothing outside them beats their worst by over 1e-4
        outside = ref.scatter(1, scores.topk_ids[i], float("-inf")).max(dim=1).values
        assert bool((scores.topk_log_probs[i][:, -1] >= outside - 1e-4).all())
        assert bool((scores.topk_log_probs[i].diff(dim=1) <= 1e-6).all())  # best first
        exact = ref.topk(K).indices
        assert (scores.topk_ids[i] == exact).float().mean() > 0.9  # ties are rare at these gaps
        # the tail's probability against float64's complement of the same ids
        complement = 1 - reference_rows(model, ids, start, torch.float64).gather(1, scores.topk_ids[i]).exp().sum(1)
        torch.testing.assert_close(scores.tail_log_probs[i].exp(), complement, rtol=0, atol=1e-4)


def test_exact_tail_loss_through_served_buckets_equals_float64(scored):
    """topk_kl of a student against the served buckets and tail equals the float64 (k+1)-bucket
    loss of transformers' float64 teacher within 1e-5; the tail-less loss (renormalized over the
    same buckets, as a top-k-only client would) is the negative control: it must miss."""
    batch, scores, model = scored
    gen = torch.Generator().manual_seed(7)
    for i, (ids, start) in enumerate(zip(batch.sequences, batch.response_starts)):
        if not batch.response_rows(i):
            continue
        student = torch.randn(batch.response_rows(i), VOCAB, generator=gen, dtype=torch.float64) * 2
        teacher64 = reference_rows(model, ids, start, torch.float64).gather(1, scores.topk_ids[i])
        expected, _ = bucket_loss(student, scores.topk_ids[i], teacher64, None, divergence="forward_kl")
        s_logp, s_tail = topk_logprobs(student, scores.topk_ids[i])
        got = topk_kl(s_logp, s_tail, scores.topk_log_probs[i], scores.tail_log_probs[i], divergence="forward_kl")
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        tailless = topk_kl(s_logp, s_tail, scores.topk_log_probs[i], scores.tail_log_probs[i],
                           divergence="forward_kl", renormalize=True)
        assert (tailless - expected).abs().max() > 1e-3


def test_rows_one_position_off_are_caught(scored):
    """Negative control of the row convention: the scores read one position late (row r scoring
    token r + 1) miss transformers' rows by far more than the tolerance."""
    batch, scores, model = scored
    ids, start = batch.sequences[1], batch.response_starts[1]
    ref = reference_rows(model, ids, start, torch.float32).double()
    late = ref[1:].gather(1, ids[start + 1:, None])[:, 0]
    assert (scores.token_log_probs[1][:-1] - late).abs().max() > 1e-2


def test_many_samples_in_flight_within_bounds(served):
    """24 samples with at most 3 requests and 600 tokens in flight: every sample as scored alone."""
    url = served.url
    batch = samples(1, [30 + 5 * (i % 7) for i in range(24)], [1 + i % 9 for i in range(24)])
    bounded = ClientSettings(max_in_flight=3, max_tokens_in_flight=600, deadline_s=120.0)
    with ServedTeacher(url, top_k=4, client=bounded) as teacher:
        together = teacher.score(batch)
        alone = teacher.score(TeacherBatch(batch.sequences[7:8], batch.response_starts[7:8]))
        client = teacher.endpoint.replicas[0].engine.client  # the one server's connection pool, kept
        assert teacher.settings.max_tokens_in_flight == 600 and client.http() is client.http()
    torch.testing.assert_close(together.topk_log_probs[7], alone.topk_log_probs[0], rtol=0, atol=1e-5)
    assert [t.shape[0] for t in together.tail_log_probs] == [batch.response_rows(i) for i in range(24)]


# ------------------------------------------------------------------ refusals, each in bounded time


def test_k_over_the_servers_limit_is_refused_naming_both(served):
    url = served.url
    start = time.monotonic()
    with pytest.raises(ServedTeacherRefusal, match=rf"top_k=25 is over the server's --max-logprobs {K}"):
        ServedTeacher(url, top_k=25, client=FAST).score(samples(2, [8], [2]))
    assert time.monotonic() - start < 30


def test_an_id_past_the_vocabulary_is_refused_naming_the_sample(served):
    url = served.url
    batch = samples(3, [8, 9, 10], [2, 2, 2])
    batch.sequences[2][4] = VOCAB + 4
    with ServedTeacher(url, top_k=K, client=FAST) as teacher:
        with pytest.raises(ServedTeacherRefusal, match=rf"\(sample 2\).*Token id {VOCAB + 4} is out of vocabulary"):
            teacher.score(batch)
        assert teacher.score(samples(3, [8], [2])).topk_ids[0].shape == (6, K)  # the server lives on


def test_a_sample_past_the_max_model_length_is_refused_naming_it(served):
    url = served.url
    with ServedTeacher(url, top_k=K, client=FAST) as teacher:
        with pytest.raises(ServedTeacherRefusal, match=rf"sample 1 has {MAX_MODEL_LEN} ids, over .* max model "
                                                       rf"length {MAX_MODEL_LEN} - 1"):
            teacher.score(samples(4, [10, MAX_MODEL_LEN], [2, 2]))
        assert teacher.score(samples(4, [MAX_MODEL_LEN - 1], [2])).tail_log_probs[0].shape == (MAX_MODEL_LEN - 3,)


def test_without_the_api_key_the_server_refuses(served, monkeypatch):
    url = served.url
    monkeypatch.delenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY")
    with pytest.raises(ServedTeacherRefusal, match=r"401.*set \$MEGATRON_RL_PATCHES_TEACHER_API_KEY"):
        ServedTeacher(url, top_k=2, client=FAST).check()


def test_a_server_that_hangs_mid_step_fails_at_the_deadline(served):
    link = Forwarder(int(served.url.rsplit(":", 1)[1]))
    teacher = ServedTeacher(link.url, top_k=K, client=ClientSettings(deadline_s=3.0, retries=1, backoff_s=0.1))
    teacher.check()  # through the link while it forwards
    link.hold_all()  # then it answers nothing
    start = time.monotonic()
    try:
        with pytest.raises(ServedTeacherError, match=rf"{link.url}(/v1/completions)? \(sample \d\): no reply within "
                                                     r"the step's deadline of 3 s"):
            teacher.score(samples(6, [20, 20], [2, 2]))
    finally:
        link.close()
        teacher.close()
    assert time.monotonic() - start < 8


def test_a_server_that_dies_mid_step_fails_naming_url_and_sample(served):
    link = Forwarder(int(served.url.rsplit(":", 1)[1]))
    teacher = ServedTeacher(link.url, top_k=K, client=FAST)
    teacher.check()
    link.hold_all()
    pending = teacher.submit(samples(7, [20] * 6, [2] * 6))
    assert link.accepted.acquire(timeout=10)  # a request is in flight
    link.close()  # connections reset, then refused
    start = time.monotonic()
    with pytest.raises(ServedTeacherError, match=rf"{link.url}/v1/completions \(sample \d\): no answer after 3 "
                                                 r"tries \("):
        pending.result()
    assert time.monotonic() - start < 10
    teacher.close()


def agreed_failure(rank: int, world: int, url: str) -> str:
    """Both ranks hold the one teacher (a group's ranks must: compared before anything is asked);
    rank 1's deadline passes before its first request."""
    import torch.distributed as dist

    teacher = ServedTeacher(url, top_k=4, client=FAST if rank == 0 else ClientSettings(deadline_s=1e-6))
    try:
        teacher.score(samples(8, [10, 12], [2, 3]), group=dist.group.WORLD)
    except ServedTeacherError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_failure_on_one_rank_is_the_same_error_on_every_rank(served):
    said = run_multirank(agreed_failure, 2, served.url, timeout=180)
    assert said[0] == said[1]
    assert said[0].startswith(f"ServedTeacherError: served teacher failed on rank 1 of the group: "
                              f"ServedTeacherError: {served.url}/v1/models: no answer")


@pytest.mark.kills_server("served")
def test_the_server_killed_mid_step_fails_the_step(served):
    """Last: the session's real server killed (its process group, SIGKILL) while a step's
    requests are in flight; the step fails naming the URL and a sample, nothing hangs."""
    url, process = served.url, served.process
    teacher = ServedTeacher(url, top_k=K, client=ClientSettings(retries=2, backoff_s=0.2, max_in_flight=2))
    teacher.check()
    pending = teacher.submit(samples(9, [MAX_MODEL_LEN - 1] * 64, [1] * 64))
    time.sleep(0.3)
    os.killpg(process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ServedTeacherError, match=rf"{url}/v1/completions \(sample \d+\): no answer after"):
        pending.result()
    assert time.monotonic() - start < 15
    teacher.close()
