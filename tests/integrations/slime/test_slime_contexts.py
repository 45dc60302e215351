"""slime's privileged contexts (`integrations.slime.contexts`): each sample's train_metadata keys
carried through the rollout manager's per-rank split (slime copies a fixed list of keys), read on
the training ranks, a missing one the same error on every rank, and kept out of slime's metrics."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
from megatron_rl_patches.integrations.megatron.opd.step_contexts import step_contexts
from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS
from megatron_rl_patches.integrations.slime import contexts, opd
from megatron_rl_patches.testing.multirank import run_multirank

SERVED = "http://127.0.0.1:9;engine=vllm;context=hint"
ENV = {"MEGATRON_RL_PATCHES_OPD_TEACHERS": SERVED, "MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teacher"}


def split_like_slime(data: dict, partitions: list[list[int]]) -> list[dict]:
    """slime 624b824a's `_split_train_data_by_dp` in little: a fixed list of keys per rank, then
    `tensorize_rollout_data_for_training` on each rank's dict (here through the wrappers)."""
    def tensorize(rollout_data: dict) -> None:
        assert all(type(t) is list for t in rollout_data["tokens"])  # slime's own tokens, whatever carried them
        rollout_data["tokens"] = [torch.as_tensor(t) for t in rollout_data["tokens"]]

    out = []
    for partition in partitions:
        rollout_data = {"partition": partition, "tokens": [data["tokens"][j] for j in partition]}
        contexts.tensorize_wrapper(tensorize, None, (rollout_data,), {})
        out.append(rollout_data)
    return out


def test_the_split_carries_each_ranks_samples_contexts_and_nothing_without_a_privileged_teacher(monkeypatch):
    data = {"tokens": [[1, 2], [3], [4, 5], [6]],
            "metadata": [{"hint": "a b", "other": 1}, {"hint": [7, 8]}, None, {"x": 0}]}

    def split(data):
        return split_like_slime(data, [[0, 2], [3, 1]])

    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    ranks = contexts.split_wrapper(split, None, (data,), {})
    assert ranks[0][CONTEXTS] == [{"hint": "a b"}, {}]
    assert ranks[1][CONTEXTS] == [{}, {"hint": [7, 8]}]
    assert data["tokens"] == [[1, 2], [3], [4, 5], [6]]  # slime's data as it was: nothing left for a later split
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", "http://127.0.0.1:9;engine=vllm")
    assert all(CONTEXTS not in rank for rank in contexts.split_wrapper(split, None, (data,), {}))


def test_contexts_read_as_ids_and_a_missing_key_named_with_the_sample():
    settings = opd_settings(ENV)
    given = [{"hint": [4, 5]}, {"hint": torch.tensor([6], dtype=torch.int32)}]
    data = {"tokens": [torch.arange(3)] * 2, "response_lengths": [2, 2], CONTEXTS: given}
    got = step_contexts(None, data, settings)
    assert [c["hint"].tolist() for c in got] == [[4, 5], [6]] and got[1]["hint"].dtype == torch.long
    data[CONTEXTS][1] = {"other": [1]}
    data["partition"] = [5, 2]
    missing = r"sample 2 \(rollout index\) has no train_metadata\['hint'\].*holds \['other'\]"
    with pytest.raises(ValueError, match=missing):
        step_contexts(None, data, settings)
    with pytest.raises(ValueError, match="without the samples' contexts.*runtime_env"):
        step_contexts(None, {"tokens": [torch.arange(3)], "response_lengths": [2]}, settings)
    with pytest.raises(ValueError, match=r"train_metadata\['hint'\]: .*contexts\[0\] holds id 64, past the teacher's "
                                         "vocabulary of 64"):
        step_contexts(None, {**data, CONTEXTS: [{"hint": [64]}, {"hint": [1]}]}, settings, vocab_size=64)
    with pytest.raises(TypeError, match=r"sample 5's train_metadata\['hint'\] must be text or token ids"):
        step_contexts(None, {**data, CONTEXTS: [{"hint": 3.5}, {"hint": [1]}]}, settings)


def rank_missing(rank: int, world_size: int) -> str:
    samples = [{"hint": [1, 2]}, {"hint": [3]}] if rank == 0 else [{"hint": [1]}, {"other": [3]}]
    data = {"tokens": [torch.arange(3)] * 2, "response_lengths": [2, 2], CONTEXTS: samples,
            "partition": [2 * rank, 2 * rank + 1]}
    try:
        step_contexts(None, data, opd_settings(ENV))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.multirank
def test_a_missing_key_on_one_sample_of_one_rank_is_the_same_error_on_every_rank():
    words = run_multirank(rank_missing, 2)
    assert words[0] == words[1], words
    assert "failed on rank 1" in words[0] and "sample 3 (rollout index) has no train_metadata['hint']" in words[0]


def test_slimes_metrics_never_see_the_contexts_or_the_metadata():
    seen = []

    def log_rollout_data(rollout_id, args, rollout_data):
        seen.append(sorted(rollout_data))

    data = {"rewards": [1.0], CONTEXTS: [{"hint": torch.arange(2)}], "metadata": [{"hint": "x"}]}
    opd.log_rollout_data_wrapper(log_rollout_data, None, (0, None, data), {})
    assert seen == [["rewards"]] and CONTEXTS in data  # the training steps still read them


def test_a_privileged_teachers_rollout_is_its_context_then_the_students_response():
    from megatron_rl_patches.integrations.megatron.opd.privileged import privileged_rollout

    data = {"tokens": [torch.tensor([1, 2, 3, 4])], "response_lengths": [2], "loss_masks": [torch.ones(2)],
            CONTEXTS: [{"hint": torch.tensor([9, 8, 7])}]}
    seen = privileged_rollout(data, "hint")
    assert seen["tokens"][0].tolist() == [9, 8, 7, 3, 4] and seen["total_lengths"] == [5]
    assert seen["response_lengths"] == [2] and data["tokens"][0].tolist() == [1, 2, 3, 4]  # the caller's untouched


def test_text_contexts_tokenized_by_the_students_tokenizer(tmp_path):
    from types import SimpleNamespace

    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path, 16)
    data = {"tokens": [torch.arange(3)] * 2, "response_lengths": [2, 2],
            CONTEXTS: [{"hint": "t3 t5 t7"}, {"hint": [2]}]}
    got = step_contexts(SimpleNamespace(hf_checkpoint=str(tmp_path)), data, opd_settings(ENV), vocab_size=16)
    assert [c["hint"].tolist() for c in got] == [[3, 5, 7], [2]]


def test_a_bad_text_after_id_contexts_and_an_id_past_int64_name_their_rollout_sample(tmp_path):
    """A text context among id contexts is named by its sample (its rollout index), not by its
    place among the texts; an id past int64 is named, not torch's bare overflow."""
    from types import SimpleNamespace

    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path, 16)
    args, settings = SimpleNamespace(hf_checkpoint=str(tmp_path)), opd_settings(ENV)
    base = {"tokens": [torch.arange(3)] * 3, "response_lengths": [2, 2, 2], "partition": [7, 4, 9]}
    for hint, words in (("t3\ud800", r"sample 9's text holds a lone surrogate"), ("", r"sample 9's text is empty")):
        with pytest.raises(ValueError, match=words):
            step_contexts(args, {**base, CONTEXTS: [{"hint": [1]}, {"hint": "t2"}, {"hint": hint}]},
                                   settings, vocab_size=16)
    with pytest.raises(ValueError, match=r"sample 4's train_metadata\['hint'\] holds id 18446744073709551616, past "
                                         "int64"):
        step_contexts(args, {**base, CONTEXTS: [{"hint": [1]}, {"hint": [2**64]}, {"hint": [2]}]}, settings)


@pytest.mark.parametrize(("text", "words"), [("", "sample 9's text is empty"),
                                             ("  ", "sample 9's text tokenizes to no ids"),
                                             ("t3\ud800", "sample 9's text holds a lone surrogate")])
@pytest.mark.parametrize("bad", ["hint", "sol"])
def test_a_bad_text_names_the_key_it_came_from_among_two_privileged_teachers(tmp_path, text, words, bad):
    """Two privileged teachers (';context=hint', ';context=sol'): a bad text names its train_metadata
    key, not only its sample (issue 96 item 9: round 11's one context owner dropped the key)."""
    from types import SimpleNamespace

    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path, 16)
    settings = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": f"{SERVED},http://127.0.0.1:10;engine=vllm;context=sol",
                             "MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teacher"})
    base = {"tokens": [torch.arange(3)] * 2, "response_lengths": [2, 2], "partition": [4, 9]}
    good = "hint" if bad == "sol" else "sol"
    given = [{"hint": "t2", "sol": [1]}, {bad: text, good: "t5"}]
    with pytest.raises(ValueError) as error:
        step_contexts(SimpleNamespace(hf_checkpoint=str(tmp_path)), {**base, CONTEXTS: given}, settings,
                               vocab_size=16)
    assert f"slime_opd: train_metadata[{bad!r}]: context_ids(texts=...): {words}" in str(error.value), error.value


def test_a_key_of_a_teacher_of_another_tokenizer_is_read_in_its_tokenizer(tmp_path):
    """`PATH;tokenizer=own;context=hint`: text through the teacher's tokenizer (PATH's tokenizer.json),
    ids checked against its vocabulary (here larger than the student's), not the student's."""
    from types import SimpleNamespace

    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    student, teacher = tmp_path / "student", tmp_path / "teacher"
    student.mkdir(), teacher.mkdir()
    save_word_tokenizer(student, 16)
    save_word_tokenizer(teacher, 40)
    settings = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": f"{teacher};tokenizer=own;context=hint"})
    args = SimpleNamespace(hf_checkpoint=str(student))
    data = {"tokens": [torch.arange(3)] * 2, "response_lengths": [2, 2],
            CONTEXTS: [{"hint": "t30 t5"}, {"hint": [39, 1]}]}
    got = step_contexts(args, data, settings, vocab_size=16)
    assert [c["hint"].tolist() for c in got] == [[30, 5], [39, 1]]
    data[CONTEXTS] = [{"hint": "t3"}, {"hint": [40]}]
    with pytest.raises(ValueError, match=r"contexts\[1\] holds id 40, past the teacher's vocabulary of 40"):
        step_contexts(args, data, settings, vocab_size=16)


@pytest.mark.parametrize("entry", ["/ckpt/teacher;tokenizer=own;context=hint", "/ckpt/teacher;tp=2;context=hint",
                                   "http://127.0.0.1:9;engine=vllm;tokenizer=/ckpt/t;context=hint"])
def test_a_privileged_teacher_of_another_tokenizer_or_layout_under_allgather_cp_is_refused_by_name(entry):
    from types import SimpleNamespace

    settings = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": entry})
    args = SimpleNamespace(allgather_cp=True, context_parallel_size=2, loss_type="custom_loss",
                           custom_loss_function_path=opd.LOSS_PATH, rollout_temperature=1.0)
    path = entry.split(";")[0]
    with pytest.raises(ValueError, match=rf"teacher\(s\) \['{path}'\] with ';context=KEY' of another tokenizer or at "
                                         r"their own layout run under --allgather-cp at --context-parallel-size 2.*"
                                         r"drop --allgather-cp"):
        opd.check_args(args, settings)
    contexts.check_layouts(SimpleNamespace(allgather_cp=False, context_parallel_size=2), settings)  # zigzag: taken
    contexts.check_layouts(SimpleNamespace(allgather_cp=True, context_parallel_size=1), settings)  # no CP: taken
    plain = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": entry.replace(";context=hint", "")})
    contexts.check_layouts(args, plain)  # without a context: as before
    contexts.check_layouts(args, opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/teacher;context=hint"}))
