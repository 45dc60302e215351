"""JSON nested past Python's recursion limit (json's decoder recurses once per level, so such text
raises RecursionError where other malformed text raises ValueError), and malformed JSON, in every
file and reply a teacher reads: a checkpoint's config.json, its model.safetensors.index.json and
tokenizer.json, the config of `;same_tokenizer;config=FILE`, a pooling reply's `metadata` header
and a reply's body read without orjson. Each is a named error (a CheckpointReadError naming the
file, a ValueError naming the entry's option, a ServedTeacherError naming the URL and the sample),
never a RecursionError."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl_patches.inference import CheckpointReadError
from megatron_rl_patches.testing.hf_checkpoints import write_safetensors

DEEP = "[" * 100_000 + "]" * 100_000  # past any recursion limit Python runs with
SHARD = "model-00001-of-00001.safetensors"


def checkpoint(root: Path, config: str | None = None, index: str | None = None) -> Path:
    """A checkpoint directory of a 16 x 4 output layer: config.json and the index as given."""
    root.mkdir()
    good_config = json.dumps({"model_type": "qwen3", "vocab_size": 16, "hidden_size": 4})
    (root / "config.json").write_text(good_config if config is None else config)
    write_safetensors(root / SHARD, {"lm_head.weight": torch.randn(16, 4)})
    good_index = json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": SHARD}})
    (root / "model.safetensors.index.json").write_text(good_index if index is None else index)
    return root


@pytest.mark.parametrize("text", [DEEP, '{"a": ' + DEEP + "}", "{not json"], ids=["deep", "deep-field", "malformed"])
@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json"])
def test_from_hf_names_a_checkpoint_file_that_holds_no_readable_json(tmp_path, file, text):
    from megatron_rl_patches.teachers import TeacherHead

    root = checkpoint(tmp_path / "ckpt", **{"config" if file == "config.json" else "index": text})
    words = "nests deeper than Python's recursion limit" if "[[[" in text else "is not JSON"
    with pytest.raises(CheckpointReadError, match=rf"{re.escape(repr(str(root / file)))}: {file} {words}"):
        TeacherHead.from_hf(root)
    assert TeacherHead.from_hf(checkpoint(tmp_path / "good")).vocab_size == 16


def test_the_vocabulary_check_names_a_deep_tokenizer_json(tmp_path):
    from megatron_rl_patches.inference import check_teacher_vocab

    root = checkpoint(tmp_path / "ckpt")
    (root / "tokenizer.json").write_text(DEEP)
    with pytest.raises(CheckpointReadError, match=r"tokenizer\.json nests deeper than Python's recursion limit"):
        check_teacher_vocab(root, root)


@pytest.fixture
def deep_config(tmp_path):
    config = tmp_path / "teacher" / "config.json"
    config.parent.mkdir()
    config.write_text('{"vocab_size": ' + DEEP + "}")
    return config


def test_build_teachers_names_a_deep_same_tokenizer_config(deep_config):
    from megatron_rl_patches.teachers import build_teachers
    from tests.teachers.local_servers import url_of, vllm_like
    from tests.teachers.test_build_teachers import WORDS, local_host

    with vllm_like() as server:
        for named in (deep_config, deep_config.parent):
            words = rf"';config={re.escape(str(named))}' is no readable config\.json \("
            file = re.escape(repr(str(deep_config)))
            with pytest.raises(ValueError, match=words + file + r" nests deeper than Python's recursion limit"):
                build_teachers(f"{url_of(server)};engine=vllm;same_tokenizer;config={named}", local_host(WORDS),
                               top_k=2)


def test_a_deep_pooling_metadata_header_is_named_with_the_sample():
    from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, ServedTeacherError, TeacherBatch
    from tests.teachers.local_servers import url_of, vllm_like
    from tests.teachers.test_teacher_step import head, pooling

    def deep_for_samples(body):
        status, (raw, headers) = pooling(body)  # the check's probe answered well
        if len(body["input"]) > 2:
            headers = {"metadata": '{"data": ' + "[" * 3000 + "]" * 3000 + "}"}
        return status, (raw, headers)

    settings = ClientSettings(retries=0, deadline_s=10)
    with vllm_like(pooling=deep_for_samples) as server, \
            ServedTeacher(url_of(server), head=head(), top_k=2, client=settings) as teacher:
        with pytest.raises(ServedTeacherError, match=r"/pooling \(sample 1\): the reply's metadata header nests "
                                                     r"deeper than Python's recursion limit") as caught:
            teacher.score(TeacherBatch([torch.arange(2), torch.arange(6)], [1, 2]))
    assert (caught.value.url, caught.value.sample) == (url_of(server), 1)


@pytest.mark.parametrize("orjson", [True, False], ids=["orjson", "json"])
def test_a_deep_reply_is_named_with_or_without_orjson(monkeypatch, orjson):
    pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    from megatron_rl_patches.teachers import ServedTeacherError
    from megatron_rl_patches.teachers.served import http as http_client
    from tests.teachers.test_vllm_malformed_replies import for_samples, scored

    if not orjson:
        monkeypatch.setitem(sys.modules, "orjson", None)  # `import orjson` raises ImportError
    else:
        pytest.importorskip("orjson")
    http_client.fast_loads.cache_clear()
    try:
        assert (http_client.fast_loads() is not None) is orjson
        with pytest.raises(ServedTeacherError, match=r"\(sample 0\): the reply nests deeper than Python's "
                                                     r"recursion limit") as caught:
            scored(v1_completions=for_samples(DEEP.encode()))
        assert caught.value.sample == 0 and str(caught.value).startswith(caught.value.url)
        with pytest.raises(ServedTeacherError, match=r"\(sample 0\): the reply is not JSON"):
            scored(v1_completions=for_samples(b"{not json"))
    finally:
        http_client.fast_loads.cache_clear()
