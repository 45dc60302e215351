"""ServedTeacher's arguments and its client's settings refused by name before anything is sent;
nothing listening named with its URL in bounded time; importing the package loads neither torch
nor the HTTP client."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from kit.ports import refused_port

from megatron_rl_patches.teachers import (
    ClientSettings,
    ServedTeacher,
    ServedTeacherError,
    ServedTeacherRefusal,
    TeacherBatch,
    agree_failure,
)


def test_sglang_is_refused_by_name():
    with pytest.raises(ValueError, match="engine='sglang' is not served yet: serve the teacher with vLLM"):
        ServedTeacher("http://127.0.0.1:9", engine="sglang", top_k=4)


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    (dict(url="http://127.0.0.1:9", engine="trt"), ValueError, "engine must be one of"),
    (dict(url="http://127.0.0.1:9", engine=["vllm"]), TypeError, r"engine must be a str .*\['vllm'\], a list"),
    (dict(url="http://127.0.0.1:9", engine=None), TypeError, "engine must be a str"),
    (dict(url="http://127.0.0.1:9", top_k=0), ValueError, r"^ServedTeacher\(top_k=...\) must be a positive int"),
    (dict(url="http://127.0.0.1:9", temperature=0.7), ValueError, "temperature 1 whatever is asked"),
    (dict(url="http://user:secret@127.0.0.1:9"), ValueError, "carries a user or password: put the API key in"),
    (dict(url="ftp://127.0.0.1:9"), ValueError, "must be http://host:port or https://host:port"),
    (dict(url="http://127.0.0.1:9/?key=1"), ValueError, "without '\\?' or '#'"),
    (dict(url="http://127.0.0.1:port"), ValueError, "has a bad port"),
    (dict(url=("127.0.0.1", 9)), TypeError, "must be a str"),
    (dict(url="http://127.0.0.1:9", client={"retries": 1}), TypeError, "must be a ClientSettings"),
])
def test_bad_arguments_are_refused_by_name(kwargs, error, words):
    with pytest.raises(error, match=words):
        ServedTeacher(**kwargs)


def test_the_secret_is_never_in_the_refusal():
    with pytest.raises(ValueError) as caught:
        ServedTeacher("https://user:secret@host:1")
    assert "secret" not in str(caught.value)


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(deadline_s=0), r"deadline_s=...\) must be a finite number of seconds > 0"),
    (dict(timeout_s=float("inf")), "timeout_s"),
    (dict(retries=-1), r"retries=...\) must be an int >= 0"),
    (dict(max_in_flight=0), "max_in_flight"),
    (dict(max_tokens_in_flight=0), "max_tokens_in_flight"),
    (dict(ca_bundle="/no/such.pem"), "ca_bundle=...\\) must be a PEM file"),
    (dict(api_key_env=""), "must name an environment variable"),
])
def test_bad_settings_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ClientSettings(**kwargs)


def test_the_api_key_comes_from_the_named_variable(monkeypatch):
    monkeypatch.setenv("MY_TEACHER_KEY", "k-123")
    assert ClientSettings(api_key_env="MY_TEACHER_KEY").api_key() == "k-123"
    monkeypatch.delenv("MY_TEACHER_KEY")
    assert ClientSettings(api_key_env="MY_TEACHER_KEY").api_key() is None


def test_nothing_listening_is_named_in_bounded_time():
    pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    with refused_port() as port:  # held for the test: no other process can take it and answer
        url = f"http://127.0.0.1:{port}"
        teacher = ServedTeacher(url, top_k=4, client=ClientSettings(retries=2, backoff_s=0.05))
        start = time.monotonic()
        with pytest.raises(ServedTeacherError, match=rf"{url}/v1/models: no answer after 3 tries \(ConnectError") \
                as caught:
            teacher.score(TeacherBatch([torch.arange(4)], [1]))
    assert caught.value.url == url and time.monotonic() - start < 5
    # a bad batch comes out of result() too (agreed over a group like a server's failure)
    with pytest.raises(TypeError, match="takes a TeacherBatch"):
        teacher.submit([torch.arange(4)]).result()  # type: ignore[arg-type]


def test_agree_failure_without_a_group_raises_here():
    agree_failure(None)
    with pytest.raises(ServedTeacherError, match="boom"):
        agree_failure(ServedTeacherError("boom", "http://x"))


def test_importing_the_package_loads_neither_torch_nor_httpx():
    code = ("import sys, json; before = set(sys.modules); import megatron_rl_patches.teachers as t; "
            "t.ClientSettings; print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       timeout=120).stdout)
    assert not {"torch", "httpx", "httpcore"} & set(loaded), loaded


def test_a_sample_over_the_max_model_length_or_ids_without_a_head_are_refused_whole():
    pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    from tests.teachers.local_servers import MAX_MODEL_LEN, url_of, vllm_like

    with vllm_like() as server, ServedTeacher(url_of(server), top_k=2, client=ClientSettings(retries=0)) as teacher:
        url = url_of(server)
        long = TeacherBatch([torch.arange(4), torch.arange(MAX_MODEL_LEN)], [1, 1])
        with pytest.raises(ServedTeacherRefusal, match=(
                rf"^sample 1 has {MAX_MODEL_LEN} ids, over {url}'s max model length {MAX_MODEL_LEN} - 1 \(the engine "
                r"generates one token after the prompt\): a sequence cannot be split \(every row needs its whole "
                rf"prefix\); serve the teacher with --max-model-len >= {MAX_MODEL_LEN + 1}$")) as caught:
            teacher.score(long)
        assert (caught.value.url, caught.value.sample) == (url, 1)
        with pytest.raises(ServedTeacherRefusal, match=r"^ServedTeacher.score\(ids=...\) needs a head \(ServedTeacher"
                                                       r"\(head=...\)\): an engine's prompt log-probs hold only the "
                                                       r"teacher's own top-k$"):
            teacher.score(TeacherBatch([torch.arange(4)], [1]), ids=[torch.zeros(1, 2, dtype=torch.long)])
