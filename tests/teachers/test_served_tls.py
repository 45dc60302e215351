"""TLS: a teacher's https URL is verified against the system's CAs (a self-signed server refused by
name) or against `ClientSettings(ca_bundle=PEM)` (the same server then answers). The server here
is a small https one of the standard library answering `/v1/models` only: TLS is all it tests."""
from __future__ import annotations

import http.server
import json
import shutil
import ssl
import subprocess
import threading

import pytest

from megatron_rl_patches.teachers import ClientSettings, ServedTeacherError
from megatron_rl_patches.teachers.served.http import Deadline, TeacherClient

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the standard library's name
        body = json.dumps({"data": [{"id": "m", "max_model_len": 64}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def https_server(tmp_path_factory):
    pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    root = tmp_path_factory.mktemp("tls")
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}", cert
    server.shutdown()


def models(url, settings):
    client = TeacherClient(url, settings)
    try:
        return client.request("GET", "/v1/models", None, Deadline.after(10), threading.Event())
    finally:
        client.close()


def test_a_self_signed_server_is_refused_against_the_system_cas(https_server):
    url, _ = https_server
    with pytest.raises(ServedTeacherError, match=rf"{url}/v1/models: TLS verification failed .*ca_bundle=PEM"):
        models(url, ClientSettings(retries=0))


def test_the_ca_bundle_setting_verifies_it(https_server):
    url, cert = https_server
    assert models(url, ClientSettings(ca_bundle=str(cert)))["data"][0]["id"] == "m"
