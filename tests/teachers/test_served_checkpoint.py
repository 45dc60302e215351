"""A pooling server of another checkpoint than the head's, refused at connect where both are
directories here: the stand-in's `/v1/models` card names its `root` as vLLM's does (the path the
server was started with). Checkpoints A and B of the same width and vocabulary; a copy of A, a hub
name and a head built by hand connect (nothing to compare, or the same checkpoint)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatron_rl_patches.teachers import ServedTeacher, ServedTeacherRefusal, TeacherHead
from megatron_rl_patches.testing.hf_checkpoints import write_safetensors
from tests.teachers.local_servers import MAX_MODEL_LEN, MODEL, url_of, vllm_like

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

V, H = 40, 8


def checkpoint(root, name: str, seed: int) -> str:
    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "vocab_size": V,
                                                       "hidden_size": H, "torch_dtype": "float32"}))
    write_safetensors(directory / "model.safetensors",
                      {"lm_head.weight": torch.randn(V, H, generator=torch.Generator().manual_seed(seed))})
    return str(directory)


def pooling(body):
    raw = torch.zeros(len(body["input"]), H).numpy().tobytes()
    item = {"index": 0, "embed_dtype": "float32", "endianness": "little", "start": 0, "end": len(raw),
            "shape": [len(body["input"]), H]}
    return 200, (raw, {"metadata": json.dumps({"data": [item]})})


def card(root: str):
    def models(_):
        return 200, {"object": "list", "data": [{"id": MODEL, "object": "model", "root": root,
                                                 "max_model_len": MAX_MODEL_LEN}]}
    return models


def test_a_server_of_another_checkpoint_is_refused_naming_both(tmp_path):
    a, b = checkpoint(tmp_path, "A", 1), checkpoint(tmp_path, "B", 2)
    shutil.copytree(a, tmp_path / "A_copy")
    with vllm_like(pooling=pooling, v1_models=card(b)) as server:
        with ServedTeacher(url_of(server), "vllm", top_k=4, head=a) as teacher:
            with pytest.raises(ServedTeacherRefusal, match=f"serves the checkpoint '{b}'.*head's directory '{a}'"):
                teacher.check()
    for root, head in ((str(tmp_path / "A_copy"), a), (a, a), ("Qwen/Qwen3-8B", a),
                       (b, TeacherHead(torch.zeros(V, H), V, V, 0))):  # nothing to compare a hand-made head with
        with vllm_like(pooling=pooling, v1_models=card(root)) as server:
            with ServedTeacher(url_of(server), "vllm", top_k=4, head=head) as teacher:
                assert teacher.check().max_model_len == MAX_MODEL_LEN
