"""A teacher's client loads certificate authorities only where TLS can happen: every request goes to
the teacher's own URL, so an http:// teacher never negotiates TLS, and the system's CAs (~30 ms a
client, one client per teacher and replica) are not loaded for it; an https:// one, or any client
given a bundle, loads them as before."""
from __future__ import annotations

import ssl

import pytest

from megatron_rl_patches.teachers import ClientSettings
from megatron_rl_patches.teachers.served.http import TeacherClient


@pytest.fixture
def loads(monkeypatch):
    pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    calls = []
    real = ssl.create_default_context

    def recorded(*args, **kwargs):
        calls.append(kwargs.get("cafile"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", recorded)
    return calls


def test_an_http_teacher_loads_no_certificate_authorities(loads):
    client = TeacherClient("http://127.0.0.1:9", ClientSettings())
    client.http()
    client.close()
    assert loads == []


def test_an_https_teacher_loads_the_systems_or_the_bundle_given(loads):
    bundle = pytest.importorskip("certifi", reason="a PEM bundle of CAs (httpx's dependency certifi)").where()
    for url, settings in (("https://127.0.0.1:9", ClientSettings()),
                          ("http://127.0.0.1:9", ClientSettings(ca_bundle=bundle))):
        client = TeacherClient(url, settings)
        client.http()
        client.close()
    assert loads == [None, bundle]
