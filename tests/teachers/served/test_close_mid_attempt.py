"""close() between an attempt's start and its first byte: the attempt then meets httpx's closed pool
(RuntimeError "Cannot send a request, as the client has been closed"), which is the close, named as
such, never that bare error (CI under load: test_close_in_flight's two-replica case met it)."""
from __future__ import annotations

import threading

import pytest

from megatron_rl_patches.teachers.errors import ServedTeacherError
from megatron_rl_patches.teachers.served.http import Deadline, TeacherClient
from megatron_rl_patches.teachers.served.settings import ClientSettings

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")


def test_an_attempt_that_meets_the_closed_pool_is_the_close():
    client = TeacherClient("http://127.0.0.1:9", ClientSettings(retries=0))
    http = client.http()

    def attempt():  # the race made certain: the teacher closes after the attempt started, before it sends
        client.close()
        return http.request("GET", "http://127.0.0.1:9/v1/models")

    assert client.within(Deadline.after(5.0), attempt, http) == (False, None)


def test_a_request_whose_pool_closes_under_it_names_the_close():
    client = TeacherClient("http://127.0.0.1:9", ClientSettings(retries=0))
    real = client.within

    def closing_within(deadline, call, http):
        def closed_first():
            client.close()
            return call()
        return real(deadline, closed_first, http)

    client.within = closing_within  # type: ignore[method-assign]
    with pytest.raises(ServedTeacherError, match="the teacher was closed while it waited for the reply"):
        client.request("GET", "/v1/models", None, Deadline.after(5.0), threading.Event())
