"""A served teacher's replicas against real vLLM servers of the lane's checkpoint (the session's
`served` and a `spare` started for these tests): the spare paused (SIGSTOP) during a step, then
killed (SIGKILL) during another — each step completes, its scores the single healthy server's;
every replica killed during a step of a 2-rank world — the same error on both ranks within the
deadline + 2 s; a replica serving another checkpoint refused at connect by its URL."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from megatron_rl_patches.teachers import (
    ClientSettings,
    ReplicaSettings,
    ServedTeacher,
    ServedTeacherRefusal,
    TeacherBatch,
)
from megatron_rl_patches.testing.multirank import run_multirank
from tests.teachers.lane.forwarder import Forwarder
from tests.teachers.lane.served_kit import VOCAB

K = 8
FAST = ClientSettings(retries=2, backoff_s=0.1, deadline_s=60.0)
HEDGED = ReplicaSettings(hedge_after=3.0, hedge_floor_s=0.5)
DEADLINE_S = 10.0


def samples(seed: int, count: int = 8, length: int = 120) -> TeacherBatch:
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (length,), generator=gen) for _ in range(count)]
    return TeacherBatch(sequences, [length // 2] * count)


def assert_close(scores, alone) -> None:
    """The lane's tolerance between two servers of one checkpoint (batched apart)."""
    for i in range(len(alone)):
        assert torch.equal(scores.topk_ids[i], alone.topk_ids[i])
        for field in ("token_log_probs", "topk_log_probs", "tail_log_probs"):
            torch.testing.assert_close(getattr(scores, field)[i], getattr(alone, field)[i], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def batch_and_alone(served):
    batch = samples(11)
    with ServedTeacher(served.url, top_k=K, client=FAST) as teacher:
        return batch, teacher.score(batch)


def test_a_replica_paused_during_a_step_is_hedged(served, spare, batch_and_alone):
    batch, alone = batch_and_alone
    group = spare.process.pid
    with ServedTeacher([served.url, spare.url], top_k=K, client=FAST, replicas=HEDGED) as teacher:
        teacher.check()
        try:
            start = time.monotonic()
            pending = teacher.submit(batch)
            os.killpg(group, signal.SIGSTOP)
            scores = pending.result()
            took = time.monotonic() - start
        finally:
            os.killpg(group, signal.SIGCONT)
    assert took < 30  # the deadline is 60 s: the paused replica's samples were answered by the other
    assert_close(scores, alone)


@pytest.mark.kills_server("spare")
def test_a_replica_killed_during_a_step_is_failed_over(served, spare, batch_and_alone):
    batch, alone = batch_and_alone
    with ServedTeacher([spare.url, served.url], top_k=K, client=FAST, replicas=HEDGED) as teacher:
        teacher.check()
        pending = teacher.submit(batch)
        time.sleep(0.1)
        os.killpg(spare.process.pid, signal.SIGKILL)
        scores = pending.result()
    assert_close(scores, alone)


def every_replica_killed(rank: int, world: int, url: str) -> tuple[str, float]:
    import torch.distributed as dist

    from megatron_rl_patches.teachers import LoopHost, TeacherStep

    settings = ClientSettings(retries=1, backoff_s=0.1, deadline_s=DEADLINE_S)
    links = [Forwarder(int(url.rsplit(":", 1)[1])) for _ in range(2)] if rank == 0 else []
    urls = [[link.url for link in links]]
    dist.broadcast_object_list(urls, src=0)  # rank 1 holds the same teacher (compared when the step is built)
    teacher = ServedTeacher(urls[0], top_k=K, client=settings)
    if rank == 0:
        teacher.check()  # connected through both links while they forward
    step = TeacherStep([teacher], LoopHost(VOCAB, dist.group.WORLD, dist.group.WORLD))
    dist.barrier()
    start = time.monotonic()
    step.send(samples(12))
    if rank == 0:
        assert links[0].accepted.acquire(timeout=10)  # requests in flight
        for link in links:
            link.close()  # each replica dies: connections reset, then refused
    try:
        step.collect()
    except Exception as error:  # noqa: BLE001 - compared across ranks
        return f"{type(error).__name__}: {error}", time.monotonic() - start
    finally:
        teacher.close()
    return "no error", time.monotonic() - start


def test_every_replica_killed_is_the_same_error_on_both_ranks_within_the_deadline(served):
    said = run_multirank(every_replica_killed, 2, served.url, timeout=180)
    (error, took0), (same, took1) = said
    assert error == same and "every one of the teacher's 2 replicas failed this step" in error, error
    assert max(took0, took1) < DEADLINE_S + 2


def test_a_replica_serving_another_checkpoint_is_refused_at_connect(pooled, bf16_pooled):
    other, _ = bf16_pooled
    with ServedTeacher([pooled.url, other], top_k=K, client=FAST, head=pooled.directory) as teacher:
        with pytest.raises(ServedTeacherRefusal) as refused:
            teacher.check()
    # refused by the replica that differs: its probe's states against the others' (the stand-in tests pin that
    # check alone), or first, with a head, its root's checkpoint against the head's (the served-checkpoint check)
    said = str(refused.value)
    assert other in said and "qwen3-bf16" in said, said
