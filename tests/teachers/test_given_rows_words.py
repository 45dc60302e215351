"""`given_rows.given_problem` called directly, in memory (issue 105 item 10, the mutation run): runs
that start past sample 0 (a `ScoredBefore`'s read run after an asked one), teachers that are not
`ServedTeacher`s (no `head` or `hidden_dtype` attribute: an asynchronous teacher of a host's own),
each refusal said whole, the values checked once a chunk (not once a sample), the chunks of a run."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron_rl_patches.teachers import BatchScores
from megatron_rl_patches.teachers.step import given_rows
from megatron_rl_patches.teachers.step.given_rows import given_problem, row_chunks
from tests.teachers.test_given_rows_held_together import VOCAB, K, rows_of, samples, twice

ORIGIN = "a test's rollout"


def part(scores: BatchScores, lo: int, hi: int) -> BatchScores:
    """Samples lo..hi-1 of `scores`, as a run of them is given."""
    return dataclasses.replace(scores, **{name: getattr(scores, name)[lo:hi] for name in (
        "token_log_probs", "topk_ids", "topk_log_probs", "tail_log_probs")})


def said(teacher, runs, batch) -> str | None:
    found = given_problem(teacher, 0, runs, batch, ORIGIN, VOCAB)
    return None if found is None else f"{type(found).__name__}: {found}"


def refusal(sample: int, rows: int, rule: str) -> str:
    return (f"ValueError: TeacherStep.add: teacher 0's rows of sample {sample} ({ORIGIN}) are not what the served "
            f"teacher answers: {rule} (its {rows} response rows at K = {K} expected): give the rows it sent, or none "
            "(the step then asks it)")


def test_a_run_after_an_asked_one_is_read_and_checked_at_its_own_samples():
    batch, good = samples(), rows_of(samples())  # 4, 3 and 5 response rows
    teacher = SimpleNamespace(top_k=K)  # no `head` attribute: a teacher without a head
    assert said(teacher, [(0, 1, None), (1, 3, part(good, 1, 3))], batch) is None
    bad = part(good, 1, 3)
    bad.topk_ids[1] = twice(0)(bad.topk_ids[1].clone())
    assert said(teacher, [(0, 1, None), (1, 3, bad)], batch) == refusal(
        2, 5, f"topk_ids holds id {int(good.topk_ids[2][0, 0])} twice in row 0 (a served reply's ids are distinct)")


def test_a_scores_answer_of_another_length_and_a_states_answer_of_another_count_are_refused_whole():
    batch, good = samples(), rows_of(samples())
    short = dataclasses.replace(part(good, 1, 3), tail_log_probs=good.tail_log_probs[1:2])
    assert said(SimpleNamespace(top_k=K), [(0, 1, None), (1, 3, short)], batch) == (
        f"ValueError: TeacherStep.add: teacher 0's rows given for samples 1..2 ({ORIGIN}): a BatchScores whose four "
        "fields are not each a list of 2 tensors (one per sample)")
    head = SimpleNamespace(top_k=K, head=SimpleNamespace(hidden_size=4))  # no `hidden_dtype`: any floating dtype
    states = [torch.zeros(batch.response_rows(i), 4) for i in range(3)]
    assert said(head, [(0, 1, None), (1, 3, states[1:])], batch) is None
    assert said(head, [(0, 1, None), (1, 3, states)], batch) == (
        f"ValueError: TeacherStep.add: teacher 0's rows given for samples 1..2 ({ORIGIN}): 3 hidden-state tensors "
        "for 2 samples")
    assert said(head, [(0, 3, good)], batch) == (
        f"TypeError: TeacherStep.add: teacher 0's rows given for samples 0..2 ({ORIGIN}) are a BatchScores: a served "
        "teacher with a head answers its hidden states, one [R, H] tensor per sample")


def test_the_values_are_checked_once_a_chunk_not_once_a_sample(monkeypatch):
    batch, good = samples(), rows_of(samples())
    calls = []
    real = given_rows.values_problem

    def counted(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(given_rows, "values_problem", counted)
    assert said(SimpleNamespace(top_k=K), [(0, 3, good)], batch) is None
    assert calls == [12]  # the run's 4 + 3 + 5 rows at once


def test_a_runs_chunks_are_its_own_samples():
    batch = samples()  # 4, 3 and 5 response rows
    assert [list(c) for c in row_chunks(batch, 1, 3)] == [[0, 1]]  # offsets from lo: samples 1 and 2
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(given_rows, "CHUNK_ROWS", 4)
        assert [list(c) for c in row_chunks(batch, 1, 3)] == [[0, 1]]  # 3 + 5 rows: past 4 at the second
        assert [list(c) for c in row_chunks(batch, 0, 2)] == [[0], [1]]
        patch.setattr(given_rows, "CHUNK_ROWS", 3)
        assert [list(c) for c in row_chunks(batch, 1, 3)] == [[0], [1]]
