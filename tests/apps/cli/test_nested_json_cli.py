"""`memory --head DIR` and `doctor` on JSON nested past Python's recursion limit (json's decoder
raised RecursionError, printed as a traceback): a usage error naming the file for `memory --head`,
a problem line naming the entry's `;config=` for `doctor`, never a traceback."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl_patches.apps import cli
from megatron_rl_patches.testing.hf_checkpoints import write_safetensors

DEEP = "[" * 100_000 + "]" * 100_000
SHARD = "model-00001-of-00001.safetensors"


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json"])
def test_memory_head_names_a_deep_checkpoint_file(cli_run, tmp_path, file):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 16, "hidden_size": 4}))
    write_safetensors(tmp_path / SHARD, {"lm_head.weight": torch.zeros(16, 4)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": SHARD}}))
    assert cli_run("memory", "--head", str(tmp_path))[0] == cli.OK
    (tmp_path / file).write_text('{"weight_map": ' + DEEP + "}")
    code, out, err = cli_run("memory", "--head", str(tmp_path))
    assert code == cli.USAGE and out == "", (code, out, err)
    assert f"{str(tmp_path / file)!r}: {file} nests deeper than Python's recursion limit" in err, err
    assert "Traceback" not in err


def test_doctor_names_a_deep_same_tokenizer_config(cli_run, monkeypatch, tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"vocab_size": ' + DEEP + "}")
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", f"http://127.0.0.1:9;engine=vllm;same_tokenizer;"
                                                           f"config={config}")
    code, out, err = cli_run("doctor", "--json")
    assert code == cli.PROBLEM and "Traceback" not in err, err
    (problem, *_) = [p for p in json.loads(out)["problems"] if f";config={config}" in p]
    assert f"is no readable config.json ({str(config)!r} nests deeper than Python's recursion limit" in problem
