"""`megatron-rl-patches serve-teacher` (issue 98) against the lane's stock vLLM servers of the same
checkpoint (conftest.py `ours`, `served`, `pooled`): groups of G in {1, 4, 8} samples sharing a
prompt of P tokens, P a multiple of the block size and not, scored through the unchanged client —
top-k rows with the tail equal the stock server's and transformers' forward within 1e-5, hidden
states the pooling server's and transformers' within 1e-5, with and without a privileged context;
the teacher tokens computed per group, read from each server's own `/metrics`, are P + G·R (plus
the prompt's last, partly filled block again for each later member) against the stock server's
G·(P + R); bad requests refused by field, the key on every route and never in a reply; and the
server's engine killed mid-step: the step fails over to the stock replica with the same rows.
One serve-teacher process for the whole lane, a handful of steps."""
from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, TeacherBatch, TeacherStep, local_host
from tests.teachers.lane.served_kit import API_KEY, MAX_LOGPROBS, MAX_MODEL_LEN, OURS_BLOCK, VOCAB

K = MAX_LOGPROBS
FAST = ClientSettings(retries=1, backoff_s=0.1, deadline_s=120.0)
BOUND = 1e-5
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# (G, P): groups of 1, 4 and 8 samples, prompts a multiple of the block size (64) and not (45)
GROUPS = [(1, 2 * OURS_BLOCK), (1, 45), (4, 2 * OURS_BLOCK), (4, 45), (8, 2 * OURS_BLOCK), (8, 45)]


def grouped(seed: int, groups: list[tuple[int, int]]) -> TeacherBatch:
    """Each group's G samples: one prompt of P ids, responses of 3..12 ids (distinct first ids: a
    response agreeing with another's would be a longer shared prefix)."""
    gen = torch.Generator().manual_seed(seed)
    sequences, starts = [], []
    for size, prompt_length in groups:
        prompt = torch.randint(0, VOCAB, (prompt_length,), generator=gen)
        firsts = torch.randperm(VOCAB, generator=gen)[:size]
        for member in range(size):
            rest = torch.randint(0, VOCAB, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen)
            sequences.append(torch.cat([prompt, firsts[member: member + 1], rest]))
            starts.append(prompt_length)
    return TeacherBatch(sequences, starts)


def log_softmax_rows(model, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' float32 log-softmax [R, V] and final hidden states [R, H] of the rows scoring ids[start:]."""
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    return torch.log_softmax(out.logits[0].double(), dim=-1)[start - 1:-1], out.hidden_states[-1][0][start - 1:-1]


def computed_tokens(url: str) -> float:
    """The prompt tokens the server's engine computed so far (vLLM's own counter, by source)."""
    import httpx

    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="local_compute"' in line)


def assert_rows_equal(got, want, batch: TeacherBatch) -> None:
    for i in range(len(batch)):
        assert torch.equal(got.topk_ids[i], want.topk_ids[i]), i
        for field in ("token_log_probs", "topk_log_probs", "tail_log_probs"):
            torch.testing.assert_close(getattr(got, field)[i], getattr(want, field)[i], rtol=0, atol=BOUND,
                                       msg=lambda said, i=i, field=field: f"sample {i} {field}: {said}")


@pytest.fixture(scope="module")
def scored(ours, served, pooled):
    """The groups scored by serve-teacher and by the stock servers: rows, and hidden states through the head."""
    batch = grouped(0, GROUPS)
    with ServedTeacher(ours.url, top_k=K, client=FAST) as mine, ServedTeacher(served.url, top_k=K,
                                                                                client=FAST) as stock:
        rows, stock_rows = mine.score(batch), stock.score(batch)
    with ServedTeacher(ours.url, top_k=K, head=ours.directory, client=FAST) as mine, \
            ServedTeacher(pooled.url, top_k=K, head=pooled.directory, client=FAST) as stock:
        states, stock_states = mine.score(batch), stock.score(batch)
    return batch, rows, stock_rows, states, stock_states


def test_rows_and_tail_equal_the_stock_server_and_transformers(scored, ours):
    batch, rows, stock_rows, _, _ = scored
    assert_rows_equal(rows, stock_rows, batch)
    for i, (ids, start) in enumerate(zip(batch.sequences, batch.response_starts)):
        reference, _ = log_softmax_rows(ours.model, ids, start)
        torch.testing.assert_close(rows.token_log_probs[i], reference.gather(1, ids[start:, None])[:, 0], rtol=0,
                                   atol=BOUND)
        torch.testing.assert_close(rows.topk_log_probs[i], reference.gather(1, rows.topk_ids[i]), rtol=0, atol=BOUND)
        complement = 1 - reference.gather(1, rows.topk_ids[i]).exp().sum(1)
        torch.testing.assert_close(rows.tail_log_probs[i].exp(), complement, rtol=0, atol=BOUND)


def test_hidden_states_equal_the_pooling_server_and_transformers(scored, ours):
    batch, _, _, states, stock_states = scored
    for i, (ids, start) in enumerate(zip(batch.sequences, batch.response_starts)):
        _, hidden = log_softmax_rows(ours.model, ids, start)
        torch.testing.assert_close(states.hidden_states[i], stock_states.hidden_states[i], rtol=0, atol=BOUND)
        torch.testing.assert_close(states.hidden_states[i], hidden, rtol=0, atol=BOUND)
        torch.testing.assert_close(states.topk_log_probs[i], stock_states.topk_log_probs[i], rtol=0, atol=BOUND)


def test_a_privileged_context_shared_by_a_group_equals_the_stock_server(ours, served):
    batch = grouped(1, [(4, 20), (8, 20)])
    gen = torch.Generator().manual_seed(2)
    contexts = {0: torch.randint(0, VOCAB, (2 * OURS_BLOCK,), generator=gen),
                4: torch.randint(0, VOCAB, (45,), generator=gen)}  # one a multiple of the block, one not
    per_sample = [contexts[0] if i < 4 else contexts[4] for i in range(len(batch))]
    with ServedTeacher(ours.url, top_k=K, client=FAST, context="hint") as mine, \
            ServedTeacher(served.url, top_k=K, client=FAST, context="hint") as stock:
        step = TeacherStep([mine, stock], local_host(VOCAB))
        step.send(batch, contexts={"hint": per_sample})
        got, want = step.collect()
    assert_rows_equal(got, want, batch)


def rank_half(rank: int, world: int, url: str) -> list[list[torch.Tensor]]:
    """This rank's half of every group's samples (rank r: members r, r + 2, ...), scored with the
    data-parallel group: both halves of a group at one server at once."""
    import torch.distributed as dist

    batch = grouped(5, [(4, 2 * OURS_BLOCK), (8, 45)])
    mine = [i for i in range(len(batch)) if i % world == rank]
    half = TeacherBatch([batch.sequences[i] for i in mine], [batch.response_starts[i] for i in mine])
    with ServedTeacher(url, top_k=K, client=FAST) as teacher:
        scores = teacher.score(half, group=dist.group.WORLD)
    return [[getattr(scores, field)[j] for field in ("token_log_probs", "topk_ids", "topk_log_probs",
                                                     "tail_log_probs")] for j in range(len(mine))]


def test_a_group_split_over_two_ranks_equals_the_stock_server(ours, served):
    from megatron_rl_patches.testing.multirank import run_multirank

    halves = run_multirank(rank_half, 2, ours.url, timeout=180)
    batch = grouped(5, [(4, 2 * OURS_BLOCK), (8, 45)])
    with ServedTeacher(served.url, top_k=K, client=FAST) as stock:
        want = stock.score(batch)
    for i in range(len(batch)):
        got = halves[i % 2][i // 2]
        assert torch.equal(got[1], want.topk_ids[i]), i
        for value, field in zip((got[0], got[2], got[3]), ("token_log_probs", "topk_log_probs", "tail_log_probs"),
                                strict=True):
            torch.testing.assert_close(value, getattr(want, field)[i], rtol=0, atol=BOUND)


def test_a_group_costs_its_prompt_once(ours, served):
    """P + G·R (and the prompt's partly filled last block again for each later member) on serve-teacher;
    G·(P + R) on the stock server. Prompts never asked before (no cached block, no kept rows)."""
    for size, prompt_length in ((8, 2 * OURS_BLOCK), (8, 45)):
        batch = grouped(100 + prompt_length, [(size, prompt_length)])
        responses = sum(batch.response_rows(i) for i in range(size))
        spent = {}
        for name, url in (("ours", ours.url), ("stock", served.url)):
            with ServedTeacher(url, top_k=K, client=FAST) as teacher:
                teacher.check()
                before = computed_tokens(url)
                teacher.score(batch)
                spent[name] = computed_tokens(url) - before
        partial = prompt_length % OURS_BLOCK
        print(f"G={size}, P={prompt_length}, R={responses / size:g} a sample: serve-teacher computed "
              f"{spent['ours']:g} tokens, the stock server {spent['stock']:g}")
        assert spent["ours"] == prompt_length + responses + (size - 1) * partial
        assert spent["stock"] == size * prompt_length + responses


def test_samples_claiming_one_response_start_with_other_prompts_get_their_own_rows(ours, served):
    """Two prompts that differ only in their last id (a block's worth shared, not the prompt): each
    sample's rows are its own full pass's, none read from the other's."""
    batch = grouped(3, [(2, 2 * OURS_BLOCK)])
    other = batch.sequences[1].clone()
    other[2 * OURS_BLOCK - 1] = (other[2 * OURS_BLOCK - 1] + 1) % VOCAB
    batch = TeacherBatch([batch.sequences[0], other, batch.sequences[0].clone()], [2 * OURS_BLOCK] * 3)
    with ServedTeacher(ours.url, top_k=K, client=FAST) as mine, ServedTeacher(served.url, top_k=K,
                                                                                client=FAST) as stock:
        assert_rows_equal(mine.score(batch), stock.score(batch), batch)


def test_bad_requests_are_refused_by_field_and_the_key_asked_everywhere(ours):
    import httpx

    name = httpx.get(ours.url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]
    too_long = httpx.post(ours.url + "/v1/completions", headers=AUTH, timeout=30,
                          json={"model": name, "prompt": [1] * (MAX_MODEL_LEN + 1), "prompt_logprobs": 1})
    assert too_long.status_code == 400 and "maximum context length is 256" in too_long.json()["error"]["message"]
    start = httpx.post(ours.url + "/pooling", headers=AUTH, timeout=30,
                       json={"model": name, "input": [1, 2], "response_start": 2})
    assert start.status_code == 400 and "response_start must be an int from 1" in start.json()["error"]["message"]
    for method, route in (("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"), ("POST", "/tokenize"),
                          ("POST", "/v1/completions"), ("POST", "/pooling")):
        for headers in ({}, {"Authorization": f"Bearer {API_KEY}x"}):
            refused = httpx.request(method, ours.url + route, headers=headers, json={}, timeout=30)
            assert refused.status_code == 401 and API_KEY not in refused.text, (route, refused.text)
    log = (ours.directory.parent / "serve-teacher.log").read_text(errors="replace")
    assert API_KEY not in log


@pytest.mark.parametrize("k", [VOCAB + 1, 10**9, 2**63])
def test_a_bad_prompt_logprobs_is_a_400_as_vllms_own_server_answers_it(ours, served, k):
    """Issue 105 item 1: serve-teacher under --max-logprobs -1 (the lane's `ours`) answered prompt_logprobs
    past the vocabulary with 500 "the teacher's engine failed: RuntimeError: selected index k out of
    range", which the client retries and fails over on; now 400 in vLLM's words (the vocabulary its
    limit, as vLLM reads -1), as the stock server answers it (its limit 20)."""
    import httpx

    body = {"prompt": [1, 2, 3], "prompt_logprobs": k, "max_tokens": 1}
    for url, limit in ((ours.url, VOCAB), (served.url, MAX_LOGPROBS)):
        name = httpx.get(url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]
        said = httpx.post(url + "/v1/completions", headers=AUTH, timeout=30, json={**body, "model": name})
        assert said.status_code == 400, (url, said.status_code, said.text)
        assert f"Requested prompt logprobs of {k}, which is greater than max allowed: {limit}" in \
            said.json()["error"]["message"], said.text
    assert httpx.get(ours.url + "/health", headers=AUTH, timeout=30).status_code == 200


def test_a_top_k_past_the_vocabulary_is_refused_and_no_replica_taken_out(ours, served):
    """The client reads that 400 as the request's fault: refused by name, no retry, no replica taken
    out (a 500 had been retried and had taken the replica out); the replicas then score as before."""
    from megatron_rl_patches.teachers.errors import ServedTeacherRefusal

    batch = grouped(6, [(2, 45)])
    with ServedTeacher([ours.url, served.url], top_k=VOCAB + 1, client=FAST) as both:
        with pytest.raises(ServedTeacherRefusal, match=r"top_k=1002 is over the server's --max-logprobs (1001|20)"):
            both.score(batch)
        said = both.metrics()
    assert said["taken_out"] == [] and said["retries"] == 0 and said["failovers"] == 0, said
    with ServedTeacher(ours.url, top_k=VOCAB + 1, client=FAST) as alone:
        with pytest.raises(ServedTeacherRefusal, match=r"top_k=1002 is over the server's --max-logprobs 1001 at "):
            alone.check()
        assert alone.metrics()["retries"] == 0
    with ServedTeacher([ours.url, served.url], top_k=K, client=FAST) as teacher:
        teacher.score(batch)
        assert teacher.metrics()["taken_out"] == []


def test_the_start_line_and_the_card_name_the_cpu_block_serve_teacher_chose(ours):
    """Issue 105 item 8: no --block-size given (the lane's `ours`), serve-teacher asks for 32 on CPU
    (vLLM's CPU default of 128 shared nothing of a prompt under 128 tokens), and says so at start."""
    import httpx

    card = httpx.get(ours.url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]
    assert card["megatron_rl_patches"]["block_size"] == OURS_BLOCK == 32
    log = (ours.directory.parent / "serve-teacher.log").read_text(errors="replace")
    assert "(prefix sharing on, KV blocks of 32 tokens: a group shares its prompt's whole blocks, so a prompt " \
           "shares nothing under 32 tokens; API key required)" in log, log[-3000:]


@pytest.mark.kills_server("ours")
def test_the_engine_killed_mid_step_fails_over_to_the_stock_replica(ours, served):
    """serve-teacher and the stock server as one teacher's replicas: serve-teacher's process group
    killed while a step is in flight; the step is answered by the stock replica, rows unchanged."""
    batch = grouped(4, [(8, 2 * OURS_BLOCK), (8, 45)])
    with ServedTeacher(served.url, top_k=K, client=FAST) as stock:
        want = stock.score(batch)
    with ServedTeacher([ours.url, served.url], top_k=K, client=FAST) as teacher:
        teacher.check()
        timer = threading.Timer(0.05, os.killpg, (ours.process.pid, signal.SIGKILL))
        timer.start()
        got = teacher.score(batch)
        timer.join()
        assert ours.process.wait(30) is not None
    assert_rows_equal(got, want, batch)
