"""`doctor` on a `;head=DIR` entry against the lane's real vLLM servers, reading no weight of the
head: the pooling server with its own checkpoint's head is no problem; a head of another hidden
size, a generate server, and a head directory whose tokenizer is not the served model's are each a
problem naming what differs."""
from __future__ import annotations

import shutil

from megatron_rl_patches.apps.cli import doctor
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint
from tests.teachers.lane.served_kit import MODEL_SHAPE, VOCAB

TEACHERS = "MEGATRON_RL_PATCHES_OPD_TEACHERS"


def teacher_problems() -> list[str]:
    return [p for p in doctor.collect()["problems"] if p.startswith(TEACHERS)]


def test_doctor_checks_a_head_entry_against_the_pooling_server(pooled, served, monkeypatch, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    monkeypatch.setenv(TEACHERS, f"{pooled.url};engine=vllm;head={pooled.directory}")
    assert teacher_problems() == []

    narrow = tmp_path / "narrow"  # the same vocabulary, hidden size 32
    write_tiny_checkpoint(narrow, tiny_hf_config("qwen3", **{**MODEL_SHAPE, "hidden_size": 32}), seed=1)
    monkeypatch.setenv(TEACHERS, f"{pooled.url};engine=vllm;head={narrow}")
    (problem,) = teacher_problems()
    assert "fails its check" in problem and "32" in problem and "64" in problem, problem

    monkeypatch.setenv(TEACHERS, f"{served.url};engine=vllm;head={pooled.directory}")  # the generate server
    (problem,) = teacher_problems()
    assert "--runner pooling" in problem, problem

    reversed_words = tmp_path / "reversed"  # the served checkpoint's head, another tokenizer beside it
    shutil.copytree(pooled.directory, reversed_words)
    other = Tokenizer(models.WordLevel({f"t{i}": VOCAB - 1 - i for i in range(VOCAB)}, unk_token="t0"))
    other.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    other.save(str(reversed_words / "tokenizer.json"))
    monkeypatch.setenv(TEACHERS, f"{pooled.url};engine=vllm;head={reversed_words}")
    (problem,) = teacher_problems()
    assert f"does not share the tokenizer ';head={reversed_words}' names" in problem, problem
