"""What `doctor` says of a served teacher's entry it checked, against stand-in vLLM servers: on
success the server it asked (URL, engine, route: hidden states through a head of V x H, or prompt
log-probs at k), with MEGATRON_RL_PATCHES_OPD_K=vocab a failure names `K=vocab` (not the unused
default k), and a pooling server asked for prompt log-probs by an entry without a head names the
entry's own option `;head=DIR`."""
from __future__ import annotations

import json

import torch

from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint
from tests.teachers.local_servers import url_of, vllm_like

TEACHERS, K = "MEGATRON_RL_PATCHES_OPD_TEACHERS", "MEGATRON_RL_PATCHES_OPD_K"
IDS_FROM = "MEGATRON_RL_PATCHES_OPD_IDS_FROM"
WIDTH = 32  # the kit's tiny qwen3


def pooling(body):
    raw = torch.zeros(len(body["input"]), WIDTH).numpy().tobytes()
    item = {"index": 0, "embed_dtype": "float32", "endianness": "little", "start": 0, "end": len(raw),
            "shape": [len(body["input"]), WIDTH]}
    return 200, (raw, {"metadata": json.dumps({"data": [item]})})


def no_completions(_):
    return 404, {"detail": "Not Found"}


def report(cli_run) -> dict:
    _, out, _ = cli_run("doctor", "--json")
    return json.loads(out)


def test_a_head_entry_that_holds_says_what_was_checked(cli_run, monkeypatch, tmp_path):
    write_tiny_checkpoint(tmp_path / "teacher", tiny_hf_config("qwen3"), seed=1)
    monkeypatch.setenv(K, "vocab")
    with vllm_like(pooling=pooling) as server:
        url = url_of(server)
        monkeypatch.setenv(TEACHERS, f"{url};engine=vllm;head={tmp_path / 'teacher'};same_tokenizer;vocab=1001")
        found = report(cli_run)
        _, text, _ = cli_run("doctor")
    assert not [p for p in found["problems"] if p.startswith(TEACHERS)], found["problems"]
    (checked,) = found["environment"]["teachers_checked"]
    assert checked.startswith(f"served teacher '{url}' (vllm, K=vocab): answers"), checked
    assert "route: hidden states through the head" in checked and "1001 x 32" in checked, checked
    assert checked in text


def test_a_failure_under_k_vocab_names_k_vocab(cli_run, monkeypatch, tmp_path):
    write_tiny_checkpoint(tmp_path / "teacher", tiny_hf_config("qwen3"), seed=1)
    monkeypatch.setenv(K, "vocab")
    monkeypatch.setenv(TEACHERS, f"http://127.0.0.1:9;engine=vllm;head={tmp_path / 'teacher'}")
    (problem,) = [p for p in report(cli_run)["problems"] if p.startswith(TEACHERS)]
    assert "(vllm, K=vocab) fails its check" in problem and "k=16" not in problem, problem


def test_a_pooling_server_without_a_head_names_the_entry_option(cli_run, monkeypatch):
    with vllm_like(pooling=pooling, v1_completions=no_completions) as server:
        monkeypatch.setenv(TEACHERS, f"{url_of(server)};engine=vllm")
        monkeypatch.setenv(IDS_FROM, "teacher")  # the top-k route's buckets (else refused before the server)
        found = report(cli_run)
    (problem,) = [p for p in found["problems"] if p.startswith(TEACHERS)]
    assert "';head=DIR'" in problem and "ServedTeacher(head=" not in problem, problem
    assert found["environment"]["teachers_checked"] == []


def test_a_top_k_entry_that_holds_names_its_route(cli_run, monkeypatch):
    with vllm_like() as server:
        monkeypatch.setenv(TEACHERS, f"{url_of(server)};engine=vllm;same_tokenizer;vocab=64")
        monkeypatch.setenv(IDS_FROM, "teacher")
        (checked,) = report(cli_run)["environment"]["teachers_checked"]
    assert "(vllm, k=16)" in checked and "route: prompt log-probs" in checked, checked
