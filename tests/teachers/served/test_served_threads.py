"""A request in flight costs the served teacher two threads at most (the request's own and the
HTTP attempt's, which the deadline can abandon), replicas or not: no thread per sample waits for
its answer, and none polls. Against stand-in servers that hold their replies."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, TeacherBatch
from tests.teachers.local_servers import held, url_of, vllm_like

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")


def teacher_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name.startswith("served-teacher"))


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_request_in_flight_holds_at_most_two_threads(replicas):
    release = threading.Event()
    batch = TeacherBatch([torch.tensor([i, 1, 2, 5, 3, 4]) for i in range(4)], [3] * 4)
    with vllm_like(v1_completions=held(release, seconds=30)) as a, \
            vllm_like(v1_completions=held(release, seconds=30)) as b:
        urls = [url_of(a), url_of(b)][:replicas]
        with ServedTeacher(urls, top_k=2, client=ClientSettings(retries=0, deadline_s=30)) as teacher:
            release.set()
            teacher.check()
            release.clear()
            before = teacher_threads()
            seen = sum(server.answered("/v1/completions") for server in (a, b))
            pending = teacher.submit(batch)
            while sum(server.answered("/v1/completions") for server in (a, b)) < seen + 4:
                time.sleep(0.01)  # the test waits for the four requests to reach the servers
            during = teacher_threads() - before
            release.set()
            pending.result()
    assert during <= 2 * 4 + 1, during  # two a request, and one watcher of the replicas
