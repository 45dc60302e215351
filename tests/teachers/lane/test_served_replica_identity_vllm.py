"""Replicas known by what they compute, against real vLLM CPU servers (issue 86 item 1): A (the
session's `served`, from the lane's checkpoint directory) and C (the `spare`, from a byte copy at
another path: another card name and root) are one teacher, each asked by its own name, the scores
within 1e-5 of A's alone; B, started from C's directory after it was overwritten with another
checkpoint (the same path and card as C), is refused at connect by its URL; and a replica behind
one URL, taken out and back as B, is probed again and kept out: the steps' scores are A's. B is
one more server for this module only (about 2 GB, started after the session's are ready)."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from kit.ports import refused_port

from megatron_rl_patches.teachers import ClientSettings, ReplicaSettings, ServedTeacher, ServedTeacherRefusal
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer
from megatron_rl_patches.testing.vllm_server import VllmServer, launch, serving
from tests.teachers.lane.early_work import offer, server_job
from tests.teachers.lane.forwarder import Forwarder
from tests.teachers.lane.served_kit import API_KEY, MAX_LOGPROBS, MAX_MODEL_LEN, MODEL_SHAPE, VLLM_PYTHON, VOCAB
from tests.teachers.lane.test_served_replicas_vllm import K, assert_close, samples

FAST = ClientSettings(retries=1, backoff_s=0.1, deadline_s=60.0)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def begin_other_weights(root: Path, _directory: Path) -> VllmServer:
    """B: a server of another checkpoint started from the spare's directory, overwritten once the
    spare had loaded it (a node holding a stale copy at the same path); begun once the lane's shared
    servers are ready (`early_work`), the spare among them."""
    copy = root / "qwen3-copy"
    save_tiny_hf(copy, "qwen3", seed=9, **MODEL_SHAPE)
    save_word_tokenizer(copy, VOCAB)
    return launch(VLLM_PYTHON, copy, root / "vllm-other.log", api_key=API_KEY, max_model_len=MAX_MODEL_LEN,
                  max_logprobs=MAX_LOGPROBS)


# B loads while the lane's other tests run (early_work)
offer("other weights", server_job(__name__, 1, begin_other_weights, lambda server: [server]))


@pytest.fixture(scope="module")
def other_weights(spare, early_work):
    """B (`begin_other_weights`), ready."""
    with serving(early_work.take("other weights")) as ready:
        yield ready


def test_the_same_weights_at_another_path_are_one_teacher(served, spare):
    batch = samples(21, count=6)
    with ServedTeacher(served.url, top_k=K, client=FAST) as alone:
        want = alone.score(batch)
    with ServedTeacher([served.url, spare.url], top_k=K, client=FAST) as teacher:
        model = teacher.check()
        got = teacher.score(batch)
    assert model.root != spare_root(spare.url)  # two paths, one teacher
    assert_close(got, want)


def spare_root(url: str) -> str:
    import httpx

    reply = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    return reply["data"][0]["root"]


def test_other_weights_at_the_same_path_are_refused(served, spare, other_weights):
    assert spare_root(other_weights.url) == spare_root(spare.url)  # the same path, the same card
    with ServedTeacher([spare.url, other_weights.url], top_k=K, client=FAST) as teacher:
        with pytest.raises(ServedTeacherRefusal, match=rf"replica {other_weights.url} scores the probe other than "
                                                       rf"replica {spare.url}: its log-probs are off by"):
            teacher.check()


def test_a_replica_back_with_other_weights_is_probed_again_and_kept_out(served, other_weights, caplog):
    batch = samples(22, count=6)
    link = Forwarder(port_of(served.url))
    with refused_port() as nothing, ServedTeacher([served.url, link.url], top_k=K, client=FAST,
                                                  replicas=ReplicaSettings(hedge_after=None)) as teacher:
        teacher.check()
        want = teacher.score(batch)
        link.retarget(nothing)  # the server behind it gone: its requests reset, it is taken out
        assert_close(teacher.score(batch), want)
        link.retarget(port_of(other_weights.url))  # back, with another checkpoint
        with caplog.at_level(logging.WARNING, logger="megatron_rl_patches.teachers.served"):
            for _ in range(3):
                assert_close(teacher.score(batch), want)
            until = time.monotonic() + 30
            while not any("other than" in r.getMessage() for r in caplog.records) and time.monotonic() < until:
                time.sleep(0.1)
    link.close()
    assert any(link.url in r.getMessage() and "scores the probe other than" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_replica_restarted_with_other_weights_between_steps_is_taken_out_at_its_recheck(spare, other_weights,
                                                                                          caplog, monkeypatch):
    """Issue 86 item 1's last sentence: C (the spare) and one URL in front of C whose server is swapped
    for B between two steps (the same path and card as C; its connections closed as a stopped
    server's are, no request failing): every later step's scores are C's (none mixes B's), and the
    replica is named as computing otherwise, taken out at its re-check. The module's servers only."""
    monkeypatch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)  # the `served` fixture's, not asked for here
    batch = samples(23, count=6)
    link = Forwarder(port_of(spare.url))
    said: list[str] = []
    with ServedTeacher([spare.url, link.url], top_k=K, client=FAST,
                       replicas=ReplicaSettings(hedge_after=None, recheck_s=0.5)) as teacher:
        teacher.check()
        want = teacher.score(batch)
        link.restart(port_of(other_weights.url))  # restarted behind the same URL with another checkpoint
        time.sleep(1.0)
        with caplog.at_level(logging.WARNING, logger="megatron_rl_patches.teachers.served"):
            until = time.monotonic() + 30
            steps = 0
            while time.monotonic() < until and not any("other than" in r.getMessage() for r in caplog.records):
                assert_close(teacher.score(batch), want)
                steps += 1
            said = [r.getMessage() for r in caplog.records]
            assert_close(teacher.score(batch), want)
    link.close()
    print(f"{steps} steps until the warning: {said}")
    assert any(link.url in words and "scores the probe other than" in words and "taken out" in words
               for words in said), said
