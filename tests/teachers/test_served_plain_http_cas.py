"""A teacher's clients share one verifying TLS context per CA bundle: loading the system's CAs costs
~30 ms, and a step opens a client per teacher and replica. Every client still verifies (https, and
http whose proxy speaks TLS, get the same context as before); a changed bundle file or CA variable
is loaded again, a bundle replaced with its old mtime too; a CA variable or bundle that gives no CA is
named when the client is made (OpenSSL skips it without a word)."""
from __future__ import annotations

import os
import re
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


def test_a_bundle_replaced_with_its_old_mtime_is_loaded_again(loads, tmp_path):
    """Issue 105 item 7: the cache was keyed by the bundle's mtime alone, so a bundle replaced (a CA
    rotated) and given its old mtime back kept the old context."""
    certifi = pytest.importorskip("certifi", reason="a PEM bundle of CAs (httpx's dependency certifi)")
    whole = open(certifi.where(), "rb").read()
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(whole)
    before = bundle.stat().st_mtime_ns
    opened("https://127.0.0.1:9", ClientSettings(ca_bundle=str(bundle)))
    rotated = tmp_path / "rotated.pem"
    rotated.write_bytes(whole[: whole.index(b"-----END CERTIFICATE-----") + 26])  # one CA of them
    os.utime(rotated, ns=(before, before))
    os.replace(rotated, bundle)
    assert bundle.stat().st_mtime_ns == before
    opened("https://127.0.0.1:9", ClientSettings(ca_bundle=str(bundle)))
    assert loads == [str(bundle), str(bundle)]
    assert VERIFIED[-1].cert_store_stats()["x509"] == 1


@pytest.mark.parametrize("case", ["garbage", "directory", "missing", "100-MB"])
def test_an_ssl_cert_file_that_gives_no_ca_is_named_when_the_client_is_made(loads, tmp_path, monkeypatch, case):
    """OpenSSL skips a default CA path it cannot read without a word (a verifying context with no CA
    of it); the client names the variable instead, before any request."""
    path = tmp_path / "ca.pem"
    if case == "garbage":
        path.write_text("not a certificate\n")
    elif case == "directory":
        path.mkdir()
    elif case == "100-MB":
        with open(path, "wb") as sparse:
            sparse.truncate(100_000_000)
    monkeypatch.setenv("SSL_CERT_FILE", str(path))
    what = {"garbage": "holds no certificate OpenSSL reads (PEM)", "100-MB": "holds no certificate OpenSSL reads (PEM)",
            "directory": "is no file, it is a folder", "missing": "is no file, it is not there"}[case]
    with pytest.raises(ValueError, match=re.escape(
            f"SSL_CERT_FILE={str(path)!r} (where OpenSSL finds the system's CAs a served teacher's TLS is verified "
            f"against) {what}: point it at a PEM file of CAs (SSL_CERT_DIR: a folder of them), unset it, or give "
            f"ClientSettings(ca_bundle=PEM)")):
        TeacherClient("http://127.0.0.1:9", ClientSettings())
    TeacherClient("http://127.0.0.1:9", ClientSettings(ca_bundle=pytest.importorskip("certifi").where())).close()


def test_an_ssl_cert_dir_that_is_no_folder_and_a_bundle_of_no_ca_are_named(loads, tmp_path, monkeypatch):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=re.escape(f"ClientSettings(ca_bundle={str(junk)!r}) holds no CA OpenSSL "
                                                   "reads (")):
        TeacherClient("https://127.0.0.1:9", ClientSettings(ca_bundle=str(junk)))
    monkeypatch.setenv("SSL_CERT_DIR", str(junk))
    with pytest.raises(ValueError, match=re.escape(f"SSL_CERT_DIR={str(junk)!r} (where OpenSSL finds the system's CAs "
                                                   "a served teacher's TLS is verified against) is no folder, it is a "
                                                   "file")):
        TeacherClient("http://127.0.0.1:9", ClientSettings())
