"""`doctor` against the lane's real vLLM server: a served entry whose server answers, serves one
model and takes k is no problem; k over the server's --max-logprobs is one, naming both numbers
(asked by `ServedTeacher.check`, nothing loaded)."""
from __future__ import annotations

from megatron_rl_patches.apps.cli import doctor
from tests.teachers.lane.served_kit import MAX_LOGPROBS

TEACHERS = "MEGATRON_RL_PATCHES_OPD_TEACHERS"


def teacher_problems() -> list[str]:
    return [p for p in doctor.collect()["problems"] if p.startswith(TEACHERS)]


def test_doctor_asks_the_served_teacher_and_names_k_over_its_limit(served, monkeypatch):
    monkeypatch.setenv(TEACHERS, f"{served.url};engine=vllm")
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_IDS_FROM", "teacher")  # a served top-k teacher's buckets (else refused)
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_K", str(MAX_LOGPROBS))
    assert teacher_problems() == []
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_K", str(MAX_LOGPROBS + 5))
    (problem,) = teacher_problems()
    assert f"served teacher '{served.url}' (vllm, k={MAX_LOGPROBS + 5}) fails its check" in problem, problem
    assert str(MAX_LOGPROBS) in problem.rpartition("fails its check")[2], problem


def test_doctor_probes_the_served_models_tokenizer_against_the_one_the_entry_names(served, monkeypatch, tmp_path):
    """`;tokenizer=DIR` naming the served model's own tokenizer is no problem; naming another (the
    served words in reverse order) is one, naming the option."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.teachers.lane.served_kit import VOCAB

    other = Tokenizer(models.WordLevel({f"t{i}": VOCAB - 1 - i for i in range(VOCAB)}, unk_token="t0"))
    other.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    other.save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setenv(TEACHERS, f"{served.url};engine=vllm;tokenizer={served.directory}")
    assert teacher_problems() == []
    monkeypatch.setenv(TEACHERS, f"{served.url};engine=vllm;tokenizer={tmp_path}")
    (problem,) = teacher_problems()
    assert f"does not share the tokenizer ';tokenizer={tmp_path}' names" in problem, problem
    assert "/tokenize" in problem, problem
