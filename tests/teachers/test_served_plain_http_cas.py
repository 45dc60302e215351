"""A teacher's clients share one verifying TLS context per CA bundle: loading the system's CAs costs
~30 ms, and a step opens a client per teacher and replica. Every client still verifies (https, and
http whose proxy speaks TLS, get the same context as before); a changed bundle file or CA variable
is loaded again."""
from __future__ import annotations

import os
import ssl

import pytest

from megatron_rl_patches.teachers import ClientSettings
from megatron_rl_patches.teachers.served import http as served_http
from megatron_rl_patches.teachers.served.http import TeacherClient


@pytest.fixture
def loads(monkeypatch):
    httpx = pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    real_client = httpx.Client

    def client(*args, **kwargs):  # what each teacher client verifies with
        VERIFIED.append(kwargs["verify"])
        return real_client(*args, **kwargs)

    monkeypatch.setattr(httpx, "Client", client)
    VERIFIED.clear()
    calls = []
    real = ssl.create_default_context

    def recorded(*args, **kwargs):
        calls.append(kwargs.get("cafile"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", recorded)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    forget()
    yield calls
    forget()


def forget() -> None:
    """The contexts loaded by earlier tests forgotten (a process's cache)."""
    served_http.loaded_context.cache_clear()


VERIFIED: list = []


def opened(url: str, settings: ClientSettings) -> ssl.SSLContext:
    client = TeacherClient(url, settings)
    client.http()
    client.close()
    return VERIFIED[-1]


def test_clients_share_one_context_per_bundle_and_every_one_verifies(loads):
    bundle = pytest.importorskip("certifi", reason="a PEM bundle of CAs (httpx's dependency certifi)").where()
    system = [opened(url, ClientSettings()) for url in ("http://127.0.0.1:9", "https://127.0.0.1:9",
                                                        "http://127.0.0.1:10")]
    given = [opened("https://127.0.0.1:9", ClientSettings(ca_bundle=bundle)) for _ in range(2)]
    assert loads == [None, bundle]  # once each, not once a client
    assert all(context is system[0] for context in system) and given[0] is given[1] is not system[0]
    assert all(c.verify_mode == ssl.CERT_REQUIRED and c.check_hostname for c in system + given)


def test_a_changed_bundle_or_ca_variable_is_loaded_again(loads, tmp_path, monkeypatch):
    certifi = pytest.importorskip("certifi", reason="a PEM bundle of CAs (httpx's dependency certifi)")
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(open(certifi.where(), "rb").read())
    opened("https://127.0.0.1:9", ClientSettings(ca_bundle=str(bundle)))
    later = bundle.stat().st_mtime_ns + 10**9  # the bundle rewritten (a CA rotated)
    os.utime(bundle, ns=(later, later))
    opened("https://127.0.0.1:9", ClientSettings(ca_bundle=str(bundle)))
    monkeypatch.setenv("SSL_CERT_FILE", certifi.where())
    opened("https://127.0.0.1:9", ClientSettings())
    assert loads == [str(bundle), str(bundle), None]
