"""A served teacher closed while its requests wait on a silent server lets the program exit at once:
its worker threads (which the interpreter joins at exit) stop waiting when it closes, instead of
at the server's reply or the request's timeout (300 s by default). Found by the served lane's
pytest process, which outlived its last test by 225 s (a request in flight on a lane server,
its teacher long closed). Against stand-in servers that hold their replies."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, ServedTeacherError, TeacherBatch
from tests.teachers.local_servers import held, url_of, vllm_like

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

HOLD_S = 60.0  # the stand-in's reply held this long, the request's own timeout as long


def waiting_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The teacher's threads that hold the interpreter's exit (the non-daemon ones), less those
    alive `before` (an earlier test's in this worker process)."""
    return [thread for thread in threading.enumerate() if thread not in before and
            thread.name.startswith("served-teacher") and not thread.daemon and thread.is_alive()]


def gone_within(seconds: float, before: set[threading.Thread]) -> list[threading.Thread]:
    """The exit-holding threads still alive after up to `seconds`."""
    until = time.monotonic() + seconds
    while waiting_threads(before) and time.monotonic() < until:
        time.sleep(0.02)
    return waiting_threads(before)


@pytest.mark.parametrize("replicas", [1, 2])
def test_closing_ends_the_waits_of_requests_in_flight(replicas):
    release = threading.Event()
    batch = TeacherBatch([torch.tensor([i, 1, 2, 5, 3, 4]) for i in range(3)], [3] * 3)
    settings = ClientSettings(retries=0, timeout_s=HOLD_S, deadline_s=HOLD_S)
    with vllm_like(v1_completions=held(release, seconds=HOLD_S)) as a, \
            vllm_like(v1_completions=held(release, seconds=HOLD_S)) as b:
        before = set(threading.enumerate())
        try:
            teacher = ServedTeacher([url_of(a), url_of(b)][:replicas], top_k=2, client=settings)
            release.set()
            teacher.check()
            release.clear()
            seen = sum(server.answered("/v1/completions") for server in (a, b))
            pending = teacher.submit(batch)
            while sum(server.answered("/v1/completions") for server in (a, b)) < seen + 3:
                time.sleep(0.01)  # the three requests reached the servers, which hold them
            assert waiting_threads(before)  # the control: requests are waited for
            started = time.monotonic()
            teacher.close()
            left = gone_within(5.0, before)
            assert not left, f"{[t.name for t in left]} still wait {time.monotonic() - started:.1f} s after close()"
            with pytest.raises(ServedTeacherError, match="closed"):
                pending.result()
        finally:
            release.set()  # the stand-ins' held handlers end


def test_a_closed_client_starts_no_attempt():
    with vllm_like() as server:
        teacher = ServedTeacher(url_of(server), top_k=2, client=ClientSettings(retries=0))
        teacher.check()
        asked = server.answered("/v1/completions")
        teacher.close()
        with pytest.raises(ServedTeacherError, match="closed"):
            teacher.score(TeacherBatch([torch.tensor([0, 1, 2, 5])], [2]))
        assert server.answered("/v1/completions") == asked
