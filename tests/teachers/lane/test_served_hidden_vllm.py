"""A hidden-state teacher against a real vLLM pooling server (the session's, conftest.py `pooled`):
its final hidden states against transformers' `last_hidden_state`, the whole vocabulary's log-probs
through the head against transformers' float64 log-softmax, K above the server's --max-logprobs,
temperature 0.7, the student's own ids, full-vocabulary divergences against a dense float64
reference over the same served states, bf16 states bit for bit, negative controls that must
fail, and the refusals by name in bounded time. Few requests, many checks each."""
from __future__ import annotations

import time

import pytest
import torch

from megatron_rl_patches import lm_head_divergence
from megatron_rl_patches.teachers import (
    ClientSettings,
    ServedTeacher,
    ServedTeacherError,
    ServedTeacherRefusal,
    TeacherBatch,
    TeacherHead,
)
from megatron_rl_patches.testing.divergence_reference import dense_divergence
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf
from tests.teachers.lane.served_kit import API_KEY, MAX_LOGPROBS, MODEL_SHAPE, VOCAB

FAST = ClientSettings(retries=1, backoff_s=0.1, deadline_s=60.0)
K = 64  # above the server's --max-logprobs
assert K > MAX_LOGPROBS
STUDENT_K, STUDENT_H = 8, 24


def samples(seed: int) -> TeacherBatch:
    gen = torch.Generator().manual_seed(seed)
    lengths, starts = [12, 40, 200, 2, 5], [3, 20, 1, 1, 5]
    return TeacherBatch([torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths], starts)


def transformers_rows(model, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' final hidden states and logits [R, ...] of the rows that score ids[start:]."""
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    return out.hidden_states[-1][0][start - 1:-1], out.logits[0][start - 1:-1]


@pytest.fixture(scope="module")
def scored(pooled):
    """One request per sample at each setting: K = vocabulary - 1 at temperature 1 with the student's
    ids, K = 64 at temperature 0.7."""
    batch = samples(0)
    head = TeacherHead.from_hf(pooled.directory)
    gen = torch.Generator().manual_seed(1)
    student_ids = [torch.rand(batch.response_rows(i), VOCAB, generator=gen).topk(STUDENT_K).indices
                   for i in range(len(batch))]
    with ServedTeacher(pooled.url, head=head, top_k=VOCAB - 1, client=FAST) as teacher:
        whole = teacher.score(batch, ids=student_ids)
    with ServedTeacher(pooled.url, head=pooled.directory, top_k=K, temperature=0.7, client=FAST) as teacher:
        warm = teacher.score(batch)
    reference = [transformers_rows(pooled.model, ids, start) for ids, start in zip(batch.sequences,
                                                                                   batch.response_starts)]
    return batch, head, student_ids, whole, warm, reference


def test_hidden_states_equal_transformers(scored):
    batch, _, _, whole, warm, reference = scored
    for i, (hidden, _) in enumerate(reference):
        assert whole.hidden_states[i].shape == (batch.response_rows(i), MODEL_SHAPE["hidden_size"])
        torch.testing.assert_close(whole.hidden_states[i], hidden, atol=1e-5, rtol=0)
        assert torch.equal(warm.hidden_states[i], whole.hidden_states[i])  # one server, the same bits


def test_whole_vocabulary_log_probs_equal_transformers_float64(scored):
    batch, _, _, whole, _, reference = scored
    for i, (_, logits) in enumerate(reference):
        want = torch.log_softmax(logits.double(), dim=-1)
        every = torch.full_like(want, torch.nan).scatter_(1, whole.topk_ids[i], whole.topk_log_probs[i])
        last = every.isnan()  # K = vocabulary - 1: the one id left is the tail bucket
        assert torch.equal(last.sum(-1), torch.ones(len(every), dtype=torch.long))
        every[last] = whole.tail_log_probs[i]
        torch.testing.assert_close(every, want, atol=1e-5, rtol=0)
        tokens = batch.sequences[i][batch.response_starts[i]:]
        torch.testing.assert_close(whole.token_log_probs[i], want.gather(1, tokens[:, None])[:, 0], atol=1e-5, rtol=0)


def test_k_above_max_logprobs_at_temperature_0_7(scored):
    """Against transformers' float32 logits / 0.7 (float64 log-softmax): the served states' float32
    error scales by 1/τ too, so the bound is 1e-5 / 0.7."""
    _, _, _, _, warm, reference = scored
    tol = 1e-5 / 0.7
    for i, (_, logits) in enumerate(reference):
        want = torch.log_softmax(logits.double() / 0.7, dim=-1)
        assert warm.topk_ids[i].shape[1] == K
        assert torch.equal(warm.topk_ids[i], want.topk(K, dim=-1).indices)
        torch.testing.assert_close(warm.topk_log_probs[i], want.gather(1, warm.topk_ids[i]), atol=tol, rtol=0)
        rest = want.scatter(1, warm.topk_ids[i], -torch.inf).logsumexp(-1)
        torch.testing.assert_close(warm.tail_log_probs[i], rest, atol=tol, rtol=0)


def test_the_students_own_ids(scored):
    _, _, student_ids, whole, _, reference = scored
    for i, (_, logits) in enumerate(reference):
        want = torch.log_softmax(logits.double(), dim=-1)
        torch.testing.assert_close(whole.ids_log_probs[i], want.gather(1, student_ids[i]), atol=1e-5, rtol=0)
        rest = want.scatter(1, student_ids[i], -torch.inf).logsumexp(-1)
        torch.testing.assert_close(whole.ids_tail_log_probs[i], rest, atol=1e-5, rtol=0)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_full_vocabulary_divergences_from_served_states(scored, divergence):
    """lm_head_divergence with the served states and the head: float64 inputs within 1e-9 of the
    dense float64 reference over the same states, float32 within 1e-5."""
    _, head, _, whole, _, _ = scored
    states = torch.cat(whole.hidden_states)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(states.shape[0], STUDENT_H, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, STUDENT_H, generator=gen, dtype=torch.float64) * 0.3
    teacher_weight = head.weight.double()
    want = dense_divergence(hidden @ weight.T, [states.double() @ teacher_weight.T], divergence=divergence,
                            temperature=0.7)
    got64 = lm_head_divergence(hidden, weight, states.double(), teacher_weight, divergence=divergence, temperature=0.7)
    torch.testing.assert_close(got64, want, atol=1e-9, rtol=0)
    got32 = lm_head_divergence(hidden.float(), weight.float(), states, head.weight, divergence=divergence,
                               temperature=0.7)
    torch.testing.assert_close(got32.double(), want, atol=1e-5, rtol=0)


def test_negative_controls_fail(scored, tmp_path):
    """A row shifted by one, and another checkpoint's head over these states, are far off."""
    batch, _, _, whole, _, reference = scored
    hidden, logits = reference[1]
    assert (whole.hidden_states[1][1:] - hidden[:-1]).abs().max() > 0.1
    save_tiny_hf(tmp_path / "other", "qwen3", seed=4, **MODEL_SHAPE)
    other = TeacherHead.from_hf(tmp_path / "other")
    tokens = batch.sequences[1][batch.response_starts[1]:]
    theirs = other.token_log_probs(whole.hidden_states[1], tokens).double()
    want = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None])[:, 0]
    assert (theirs - want).abs().max() > 0.1


def test_bf16_states_equal_the_json_reply_rounded_bit_for_bit(pooled, scored):
    # the served extra: the lanes without it (oldest, newest) collect this file too
    httpx = pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    batch, head = scored[0], scored[1]
    ids = batch.sequences[1]
    with ServedTeacher(pooled.url, head=head, hidden_dtype=torch.bfloat16, client=FAST) as teacher:
        got = teacher.score(TeacherBatch([ids], [20])).hidden_states[0]
    reply = httpx.post(f"{pooled.url}/pooling", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                       json={"model": str(pooled.directory), "input": ids.tolist(), "task": "token_embed",
                             "use_activation": False, "encoding_format": "float", "add_special_tokens": False})
    as_json = torch.tensor(reply.json()["data"][0]["data"], dtype=torch.float32)[19:-1]
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), as_json.bfloat16().view(torch.int16))


def test_refusals_by_name_in_bounded_time(pooled, served, tmp_path):
    head_dir = tmp_path / "narrow"
    save_tiny_hf(head_dir, "qwen3", seed=5, **{**MODEL_SHAPE, "hidden_size": 32})
    other_dir = tmp_path / "other"  # another checkpoint of the served one's width and vocabulary
    save_tiny_hf(other_dir, "qwen3", seed=4, **MODEL_SHAPE)
    batch = TeacherBatch([torch.arange(6)], [2])
    cases = [(lambda: ServedTeacher(served.url, head=pooled.directory, client=FAST),
              "does not serve /pooling .*--runner pooling --convert embed"),
             (lambda: ServedTeacher(pooled.url, top_k=4, client=FAST),
              "a pooling server .*sends hidden states, not prompt log-probs"),
             (lambda: ServedTeacher(pooled.url, head=head_dir, client=FAST),
              "width 64 came back, but the teacher's head has hidden size 32"),
             (lambda: ServedTeacher(pooled.url, head=other_dir, client=FAST),  # vLLM's card names its root
              f"serves the checkpoint '{pooled.directory}' .*differs from the head's directory '{other_dir}'")]
    for make, words in cases:
        started = time.monotonic()
        with make() as teacher, pytest.raises(ServedTeacherRefusal, match=words):
            teacher.score(batch)
        assert time.monotonic() - started < 20
    long = TeacherBatch([torch.zeros(300, dtype=torch.long)], [1])
    with ServedTeacher(pooled.url, head=pooled.directory, client=FAST) as teacher:
        with pytest.raises(ServedTeacherRefusal, match="sample 0 has 300 ids, over .*max model length 256: "):
            teacher.score(long)
        assert isinstance(teacher.check().max_model_len, int)
    assert issubclass(ServedTeacherRefusal, ServedTeacherError)


def sharded_head_scores(rank: int, world: int, url: str, directory: str) -> tuple:
    """One rank of a TP=2 student: its vocabulary shard of the head, the same batch on both ranks."""
    import torch.distributed as dist

    head = TeacherHead.from_hf(directory, tp_group=dist.group.WORLD)
    with ServedTeacher(url, head=head, top_k=K, temperature=0.7, client=FAST) as teacher:
        scores = teacher.score(samples(0), group=dist.group.WORLD)
    return head.weight.shape, scores.token_log_probs, scores.topk_ids, scores.topk_log_probs, scores.tail_log_probs


def test_a_head_sharded_over_tp2_scores_as_the_whole_head(pooled, scored):
    from megatron_rl_patches.testing.multirank import run_multirank

    warm = scored[4]
    ranks = run_multirank(sharded_head_scores, 2, pooled.url, str(pooled.directory), timeout=300)
    for shape, token, ids, values, tail in ranks:
        assert tuple(shape) == (512, MODEL_SHAPE["hidden_size"])  # 1001 padded to 1024, half a rank
        for i in range(len(token)):
            assert torch.equal(ids[i], warm.topk_ids[i])
            for got, want in ((token[i], warm.token_log_probs[i]), (values[i], warm.topk_log_probs[i]),
                              (tail[i], warm.tail_log_probs[i])):
                torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
