"""`carried_rows` in memory (no server): what `packed` writes and `carried_entry` reads back, its
refusals' words whole, `take_rows`' move of the carried rows out of the split's keys. The route
against a local server: `test_slime_rollout_scores.py`."""
from __future__ import annotations

import types

import pytest
import torch

from megatron_rl_patches.integrations.megatron.opd.carried_rows import (
    CARRIED,
    ROWS,
    add_carried,
    carried_entry,
    packed,
    take_rows,
    teacher_key,
)
from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS
from megatron_rl_patches.teachers import TeacherBatch
from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.step.parts import ids_digest


def one_sample() -> tuple[BatchScores, TeacherBatch]:
    ids = torch.tensor([[3, 1], [2, 0]])
    values = torch.tensor([[-0.25, -1.5], [-0.5, -2.0]], dtype=torch.float64)
    scores = BatchScores([torch.tensor([-0.25, -0.5], dtype=torch.float64)], [ids], [values],
                         [torch.tensor([-3.0, -4.0], dtype=torch.float64)])
    return scores, TeacherBatch([torch.tensor([7, 5, 3, 2])], [2])


def refusal(sample: int, key: str, what: str) -> str:
    """`carried_entry`'s refusal, whole."""
    return (f"slime_opd: sample {sample}'s train_metadata[{ROWS!r}][{key!r}] {what}: it is not what the rollout's "
            "hook writes (carried_rows.packed); drop the field (the train step then asks the teacher) or let the "
            "hook write it")


def test_packed_rows_travel_as_int32_and_float32_and_read_back_as_the_clients_dtypes():
    scores, batch = one_sample()
    entry = packed(scores, batch)
    assert entry["digest"] == ids_digest(batch.sequences[0], 2) == ids_digest(torch.tensor([7, 5, 3, 2]), 2)
    assert [entry[name].dtype for name in ("ids", "values", "tails", "token")] == \
        [torch.int32, torch.float32, torch.float32, torch.float32]
    digest, read = carried_entry(entry, 0, "k")
    assert digest == entry["digest"] and all(type(v) is int for v in digest)
    assert [t[0].dtype for t in (read.token_log_probs, read.topk_ids, read.topk_log_probs, read.tail_log_probs)] == \
        [torch.float64, torch.int64, torch.float64, torch.float64]
    assert torch.equal(read.topk_ids[0], scores.topk_ids[0]) and \
        torch.equal(read.topk_log_probs[0], scores.topk_log_probs[0]) and \
        torch.equal(read.tail_log_probs[0], scores.tail_log_probs[0]) and \
        torch.equal(read.token_log_probs[0], scores.token_log_probs[0])


def test_a_malformed_entrys_refusal_is_said_whole():
    with pytest.raises(ValueError) as caught:
        carried_entry("rows", 4, "abcd0123")
    assert str(caught.value) == refusal(4, "abcd0123",
                                        "is a str, not a mapping of digest, ids, values, tails and token")


def test_take_rows_moves_the_carried_rows_and_leaves_the_contexts():
    data = {CONTEXTS: [{ROWS: "a", "ctx": [1]}, "not a dict", {"ctx": [2]}]}
    take_rows(data)
    assert data == {CONTEXTS: [{"ctx": [1]}, "not a dict", {"ctx": [2]}], CARRIED: ["a", None, None]}
    data = {CONTEXTS: [{ROWS: "a"}, {}]}
    take_rows(data)
    assert data == {CARRIED: ["a", None]}
    untouched = {CONTEXTS: [{"ctx": [1]}]}
    take_rows(untouched)
    assert untouched == {CONTEXTS: [{"ctx": [1]}]}


@pytest.mark.parametrize(("digest", "shown"), [
    ([1, 2, "a"], "[1, 2, 'a']"),
    ([1, 2], "[1, 2]"),
    (5, "5"),
    (b"\x01\x02\x03", "b'\\x01\\x02\\x03'"),
    ([1, True, 2], "[1, True, 2]"),
    ("x" * 100, "'" + "x" * 59),
], ids=["a-text-in-three", "two-ints", "an-int", "three-bytes", "a-bool", "a-long-text-cut-at-60"])
def test_a_digest_that_is_not_three_ints_is_refused_whole(digest, shown):
    entry = {**packed(*one_sample()), "digest": digest}
    with pytest.raises(ValueError) as caught:
        carried_entry(entry, 1, "k")
    assert str(caught.value) == refusal(1, "k", f"holds a digest {shown} that is not three ints (ids_digest)")


@pytest.mark.parametrize(("name", "dtype", "expected"), [
    ("ids", torch.bool, "integer ids"),
    ("values", torch.int64, "floating log-probs"),
    ("token", torch.complex64, "floating log-probs"),
])
def test_rows_of_another_dtype_are_refused_whole(name, dtype, expected):
    entry = packed(*one_sample())
    entry[name] = entry[name].to(dtype)
    with pytest.raises(ValueError) as caught:
        carried_entry(entry, 0, "k")
    assert str(caught.value) == refusal(0, "k", f"holds {name} of dtype {dtype} ({expected} expected)")


class RecordingStep:
    """What `add_carried` reads of a one-teacher `TeacherStep` and what it hands it, recorded."""

    def __init__(self, vocab):
        self.teachers = [types.SimpleNamespace(url="http://t:1", engine_name="vllm", top_k=2, temperature=1.0)]
        self.keys = [None]
        self.host = types.SimpleNamespace(vocab_size=vocab)
        self.added: list = []
        self.refused: list = []

    def add(self, batch, contexts=None, scored=None):
        self.added.append((batch, contexts, scored))

    def refuse(self, error):
        self.refused.append(error)


def carried_for(step: RecordingStep, entries: list) -> dict:
    key = teacher_key(step.teachers[0], None)
    return {CARRIED: [None if e is None else {key: e} for e in entries]}


def test_add_carried_adds_nothing_where_no_row_was_carried_for_its_samples():
    scores, batch = one_sample()
    step = RecordingStep(8)
    assert add_carried(step, batch, None, {}) is False
    assert add_carried(step, batch, None, {CARRIED: None}) is False
    assert add_carried(step, batch, None, {CARRIED: [None, None]}) is False  # another length than the batch's
    assert add_carried(step, batch, None, carried_for(step, [None])) is False
    assert add_carried(step, batch, None, {CARRIED: [{"another teacher": packed(scores, batch)}]}) is False
    assert step.added == [] and step.refused == []


def test_add_carried_refuses_a_malformed_entry_through_the_step_and_says_it_added():
    _, batch = one_sample()
    step = RecordingStep(8)
    assert add_carried(step, batch, None, carried_for(step, ["rows"])) is True
    assert step.added == [] and len(step.refused) == 1 and "is a str, not a mapping" in str(step.refused[0])


@pytest.mark.parametrize(("vocab", "given"), [(8, 8), (1, 1), (0, None), (-1, None), (True, None), ("8", None)])
def test_add_carried_hands_the_step_its_rows_and_the_students_vocabulary_where_it_is_one(vocab, given):
    scores, batch = one_sample()
    step = RecordingStep(vocab)
    entry = packed(scores, batch)
    assert add_carried(step, batch, "contexts", carried_for(step, [entry])) is True
    ((added_batch, contexts, scored),) = step.added
    assert added_batch is batch and contexts == "contexts" and list(scored) == [0]
    before = scored[0]
    assert before.vocab_size == given and before.origin == \
        f"slime's train_metadata[{ROWS!r}], carried from the rollout"
    ((digest, answer),) = before.samples
    assert digest == entry["digest"] and torch.equal(answer.topk_ids[0], scores.topk_ids[0])


def test_a_teachers_key_is_its_served_identity_and_context_key_not_its_head():
    def teacher(**change):  # no `head` attribute: the key never reads one
        return types.SimpleNamespace(**{"url": "http://u:p@t:1", "engine_name": "vllm", "top_k": 2,
                                        "temperature": 1.0, **change})

    key = teacher_key(teacher(), None)
    assert len(key) == 8 and int(key, 16) >= 0 and key == teacher_key(teacher(url="http://u:other@t:1"), None)
    others = {teacher_key(teacher(), "ctx"), teacher_key(teacher(url="http://t:2"), None),
              teacher_key(teacher(engine_name="sglang"), None), teacher_key(teacher(top_k=3), None),
              teacher_key(teacher(temperature=0.5), None)}
    assert key not in others and len(others) == 5
