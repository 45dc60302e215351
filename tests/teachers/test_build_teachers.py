"""Teachers built from entries through their kinds (`teachers.build_teachers`): a served entry
built and connected on the host's asking rank (its tokenizer probed against the student's, or its
`;same_tokenizer;vocab=N` checked without sending ids), scoring as a `ServedTeacher` made by hand
does and running in a `TeacherStep`; an in-process kind built by the host's `build_teacher` or
refused by name; every bad argument refused before anything is asked of a server."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers import (
    LoopHost,
    ServedTeacher,
    TeacherBatch,
    TeacherStep,
    build_teachers,
    local_host,
)
from megatron_rl_patches.teachers.kinds import parse_entry
from tests.teachers.local_servers import url_of, vllm_like

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
pytest.importorskip("tokenizers", reason="the tokenizers library is missing")

WORDS = 50  # the student's word tokenizer: id i spells "ti", as the local server tokenizes
BATCH = TeacherBatch([torch.tensor([1, 7, 3, 9, 4]), torch.tensor([2, 5, 8])], [2, 1])


@pytest.fixture
def student(tmp_path):
    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path, WORDS)
    return tmp_path


def paths(server) -> list[str]:
    return [path for path, _ in server.seen]


def test_a_served_entry_is_probed_connected_and_scores_as_one_made_by_hand(student):
    with vllm_like() as server:
        (teacher,) = build_teachers(f"{url_of(server)};engine=vllm", local_host(WORDS), top_k=3,
                                    student_tokenizer=student)
        with teacher, ServedTeacher(url_of(server), top_k=3) as by_hand:
            assert isinstance(teacher, ServedTeacher) and teacher.top_k == 3
            assert "/tokenize" in paths(server) and "/v1/models" in paths(server)
            got, want = teacher.score(BATCH), by_hand.score(BATCH)
    for field in ("token_log_probs", "topk_ids", "topk_log_probs", "tail_log_probs"):
        for a, b in zip(getattr(got, field), getattr(want, field)):
            assert torch.equal(a, b), field


def test_the_built_teachers_run_in_a_teacher_step(student):
    with vllm_like() as server:
        teachers = build_teachers([f"{url_of(server)};engine=vllm"], local_host(WORDS), top_k=2,
                                  student_tokenizer=str(student / "tokenizer.json"))
        step = TeacherStep(teachers, local_host(WORDS))
        step.send(BATCH)
        (scores,) = step.collect()
        teachers[0].close()
    assert step.plan.top_k == 2 and [ids.shape for ids in scores.topk_ids] == [(3, 2), (2, 2)]


def test_same_tokenizer_checks_the_named_vocabulary_without_sending_ids():
    with vllm_like() as server:
        (teacher,) = build_teachers(f"{url_of(server)};engine=vllm;same_tokenizer;vocab={WORDS}", local_host(WORDS),
                                    top_k=2)
        teacher.close()
        assert "/tokenize" not in paths(server)
        with pytest.raises(ValueError, match=r"entry 'http://127\.0\.0\.1:\d+'.*ids up to 49, past the served "
                                             r"model's vocabulary of 10"):
            build_teachers(f"{url_of(server)};engine=vllm;same_tokenizer;vocab=10", local_host(WORDS), top_k=2)


def test_an_in_process_kind_is_the_hosts_to_build(student, tmp_path):
    built = []

    def build_teacher(entry, options):
        built.append((entry, options.top_k, options.temperature))
        return "the host's model"

    with vllm_like() as server:
        entries = f"{url_of(server)};engine=vllm, {tmp_path}/ckpt"
        with pytest.raises(ValueError, match=r"entry '.*/ckpt' is a checkpoint teacher.*this host builds none.*"
                                             r"build_teacher\(entry, options\)"):
            build_teachers(entries, local_host(WORDS), top_k=2, student_tokenizer=student)
        assert server.seen == []  # refused before the served entry was connected
        served, model = build_teachers(entries, LoopHost(WORDS, build_teacher=build_teacher), top_k=2,
                                       student_tokenizer=student)
        served.close()
    assert model == "the host's model" and isinstance(served, ServedTeacher)
    assert built == [(parse_entry(f"{tmp_path}/ckpt"), 2, 1.0)]


class Closing:
    """A host's teacher that notes being closed."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_failed_build_closes_the_teachers_built_before_it():
    built: list[Closing] = []

    def build_teacher(entry, options):
        if entry.path.endswith("broken"):
            raise OSError("no such checkpoint")
        built.append(Closing())
        return built[-1]

    with pytest.raises(OSError, match="no such checkpoint"):
        build_teachers("/ckpt/a,/ckpt/broken", LoopHost(WORDS, build_teacher=build_teacher), top_k=2)
    assert [teacher.closed for teacher in built] == [True]


@pytest.mark.parametrize(("entries", "options", "error", "words"), [
    ("{url};engine=vllm", {}, ValueError,
     r"pass build_teachers\(student_tokenizer=\.\.\.\).*';same_tokenizer;vocab=N'"),
    ("{url};engine=vllm;tokenizer={student}", {"student_tokenizer": True}, ValueError,
     r"';tokenizer=.*another tokenizer than the student's.*';head=DIR'"),
    ("{url};engine=vllm", {"top_k": 0, "student_tokenizer": True}, ValueError,
     r"build_teachers\(top_k=\.\.\.\) must be a positive int \(the teacher's buckets per row\), got 0"),
    ("{url};engine=vllm", {"temperature": -1.0, "student_tokenizer": True}, ValueError,
     r"build_teachers\(temperature=\.\.\.\) must be a finite number > 0 \(its reciprocal finite\), got -1\.0"),
    ("", {}, ValueError, r"names no teacher"),
    (b"x", {}, TypeError, r"a comma-separated str or a list"),
    ([3], {}, TypeError, r"an entry is a str or a TeacherEntry, got int"),
])
def test_bad_arguments_are_refused_before_any_request(student, entries, options, error, words):
    with vllm_like() as server:
        if isinstance(entries, str):
            entries = entries.format(url=url_of(server), student=student)
        kwargs = {"top_k": 2, **options}
        if kwargs.get("student_tokenizer") is True:
            kwargs["student_tokenizer"] = student
        with pytest.raises(error, match=words):
            build_teachers(entries, local_host(WORDS), **kwargs)
        assert server.seen == []


def test_a_host_without_groups_is_refused_by_name():
    with pytest.raises(TypeError, match=r"build_teachers\(host=\.\.\.\) has no share_group"):
        build_teachers("http://h:1;engine=vllm;same_tokenizer;vocab=5", object(), top_k=2)


def test_same_tokenizer_vocabulary_is_compared_with_the_heads(tmp_path):
    """`;same_tokenizer;vocab=N` names the served model's vocabulary; `;head=DIR` is that model's head:
    two sizes, one model. Refused naming both, on the entry and in doctor, before any request."""
    import json

    from megatron_rl_patches.teachers.entry import RunFacts
    from megatron_rl_patches.teachers.kinds.served_entry import problems
    from megatron_rl_patches.testing.hf_checkpoints import write_safetensors

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64,
                                                  "hidden_size": 8, "torch_dtype": "float32"}))
    write_safetensors(head / "model.safetensors", {"lm_head.weight": torch.randn(64, 8)})
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100}))
    with vllm_like() as server:
        for named in ("vocab=100", f"config={tmp_path / 'config.json'}"):
            entry = f"{url_of(server)};engine=vllm;head={head};same_tokenizer;{named}"
            with pytest.raises(ValueError, match=r"names a served vocabulary of 100, but the head of .*has 64 rows"):
                build_teachers(entry, local_host(100), top_k=2)
            said = problems(parse_entry(entry), RunFacts(k=2))
            assert any("vocabulary of 100" in line and "64 rows" in line for line in said), said
        assert server.seen == []
