"""Given rows checked against each other (issue 105 items 3 and 4), in memory: a teacher step's
given rows (`TeacherStep.add(scored=)`, a `ScoredBefore`, slime's carried rows) must hold what a
served reply holds by construction — its ids are one dict's keys (none twice in a row), the client
forms the tail (log(1 - sum exp(top-k)) within the reply tolerance), the actual token's log-prob is
its own top-k entry's — or they are refused naming the teacher, the sample and the rule; rows or
states on the meta device (a shape without data) are a named refusal (a bare RuntimeError from
`Tensor.item()` before, outside the errors a step agrees over its ranks; the 2-rank case:
test_teacher_step.py's `given_rows_meta`). Rows that hold together are read, nothing asked. The
teacher's URL answers nothing: every row is given."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from megatron_rl_patches.integrations.megatron.opd.carried_rows import CARRIED, add_carried, packed, teacher_key
from megatron_rl_patches.teachers import BatchScores, ServedTeacher, TeacherBatch, TeacherStep, local_host
from megatron_rl_patches.teachers.step.parts import ScoredBefore, ids_digest
from megatron_rl_patches.teachers.tails import tail_log_probs
from tests.teachers.test_teacher_step import H, head

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

VOCAB, K = 12, 4
DEAD = "http://127.0.0.1:9"  # never asked


def samples() -> TeacherBatch:
    gen = torch.Generator().manual_seed(0)
    return TeacherBatch([torch.randint(0, VOCAB, (n,), generator=gen) for n in (7, 5, 9)], [3, 2, 4])


def rows_of(batch: TeacherBatch) -> BatchScores:
    """Each sample's rows as a served teacher answers them: a distribution's top-K (best first), the
    exact tail, the actual token's log-prob (its own entry where it is one of the top-K). Row 0 of
    every sample scores a token among its top-K: its own entry is checked."""
    gen = torch.Generator().manual_seed(1)
    token, ids, values, tails = [], [], [], []
    for sequence, start in zip(batch.sequences, batch.response_starts):
        actual = sequence[start:]
        logits = torch.randn(len(actual), VOCAB, generator=gen, dtype=torch.float64)
        logits[0, actual[0]] += 10.0  # the first row's token is its top-1
        log_probs = torch.log_softmax(logits, dim=-1)
        top = log_probs.topk(K, dim=-1)
        token.append(log_probs.gather(1, actual[:, None])[:, 0])
        ids.append(top.indices)
        values.append(top.values)
        tails.append(tail_log_probs(top.values))
    return BatchScores(token, ids, values, tails)


def refused(sample: int, rule: str, origin: str = "scored= of TeacherStep.add()") -> str:
    return re.escape(f"TeacherStep.add: teacher 0's rows of sample {sample} ({origin}) are not what the served "
                     f"teacher answers: {rule}")


def one_sample_changed(scores: BatchScores, sample: int, **fields) -> BatchScores:
    """`scores` with sample `sample`'s tensor of each field replaced by what `fields` makes of a copy."""
    return dataclasses.replace(scores, **{
        name: [make(t.clone()) if i == sample else t for i, t in enumerate(getattr(scores, name))]
        for name, make in fields.items()})


def put(row: int, column: int | None, value: float):
    def change(tensor: torch.Tensor) -> torch.Tensor:
        tensor[row if column is None else (row, column)] = value
        return tensor
    return change


def twice(row: int):
    def change(ids: torch.Tensor) -> torch.Tensor:
        ids[row, 1] = ids[row, 0]
        return ids
    return change


def test_rows_that_hold_together_are_read_and_nothing_asked():
    batch, scores = samples(), rows_of(samples())
    assert all(bool((s.topk_ids[0] == seq[start]).any()) for s, seq, start in zip(
        [dataclasses.replace(scores, topk_ids=[i]) for i in scores.topk_ids], batch.sequences, batch.response_starts))
    with ServedTeacher(DEAD, top_k=K) as teacher:
        step = TeacherStep([teacher], local_host(VOCAB))
        step.add(batch, scored={0: scores})
        (got,) = step.collect()
    assert all(torch.equal(a, b) for a, b in zip(got.topk_log_probs, scores.topk_log_probs))


@pytest.mark.parametrize(("sample", "fields", "rule"), [
    (1, dict(topk_ids=twice(2)), "topk_ids holds id {id} twice in row 2 (a served reply's ids are distinct)"),
    (2, dict(tail_log_probs=put(3, None, 0.0)), "tail_log_probs is not log(1 - sum exp(topk_log_probs)) in row 3: "
                                                "e^0 = 1 against 1 - "),
    (0, dict(token_log_probs=put(0, None, -5.0)), "token_log_probs differs from its own top-k entry in row 0: id "
                                                  "{token} scores -5 as the token and "),
], ids=["one-id-twice", "tail-0-beside-a-mass", "token-not-its-entry"])
def test_rows_that_a_served_reply_could_not_hold_together_are_refused_by_sample_and_rule(sample, fields, rule):
    batch, good = samples(), rows_of(samples())
    bad = one_sample_changed(good, sample, **fields)
    rule = rule.format(id=int(good.topk_ids[sample][2, 0]), token=int(batch.sequences[sample][batch.response_starts[
        sample]]))
    with ServedTeacher(DEAD, top_k=K) as teacher:
        step = TeacherStep([teacher], local_host(VOCAB))
        with pytest.raises(ValueError, match=refused(sample, rule)):
            step.add(batch, scored={0: bad})
        assert step.batch is None  # nothing added
        before = ScoredBefore([(ids_digest(ids, start), one_sample(bad, i)) for i, (ids, start) in enumerate(
            zip(batch.sequences, batch.response_starts))], origin="a test's rollout", vocab_size=VOCAB)
        with pytest.raises(ValueError, match=refused(sample, rule, "a test's rollout")):
            step.add(batch, scored={0: before})


def one_sample(scores: BatchScores, i: int) -> BatchScores:
    return BatchScores(*([getattr(scores, name)[i]] for name in ("token_log_probs", "topk_ids", "topk_log_probs",
                                                                  "tail_log_probs")))


@pytest.mark.parametrize("mass", [0.3, 0.5, 0.9])
def test_a_tail_of_zero_beside_any_top_k_mass_is_refused_and_a_tail_within_the_tolerance_read(mass):
    """Sample 0's rows: top-K of mass `mass` (the actual tokens outside them); its tail 0 is refused,
    the exact tail off by less than 1e-3 in probability is read (a carried float32 tail)."""
    batch = TeacherBatch([torch.tensor([11, 11, 11, 11])], [1])
    values = torch.log(torch.full((3, K), mass / K, dtype=torch.float64))
    ids = torch.arange(K).expand(3, K).clone()
    token = torch.full((3,), math.log((1 - mass) / 8), dtype=torch.float64)
    exact = tail_log_probs(values)
    with ServedTeacher(DEAD, top_k=K) as teacher:
        with pytest.raises(ValueError, match=refused(0, "tail_log_probs is not log(1 - sum exp(topk_log_probs)) in "
                                                        f"row 0: e^0 = 1 against 1 - {mass:.4g} = {1 - mass:.4g}, "
                                                        "beyond 0.001")):
            TeacherStep([teacher], local_host(VOCAB)).add(batch, scored={0: BatchScores(
                [token], [ids], [values], [torch.zeros(3, dtype=torch.float64)])})
        near = torch.log(exact.exp() + 9e-4)
        step = TeacherStep([teacher], local_host(VOCAB))
        step.add(batch, scored={0: BatchScores([token], [ids], [values], [near])})
        step.collect()


def test_slimes_carried_rows_are_checked_together_naming_the_field():
    batch, good = samples(), rows_of(samples())
    bad = one_sample_changed(good, 1, topk_ids=twice(0))
    with ServedTeacher(DEAD, top_k=K) as teacher:
        key = teacher_key(teacher, None)
        carried = [{key: packed(one_sample(bad, i), TeacherBatch([ids], [start]))}
                   for i, (ids, start) in enumerate(zip(batch.sequences, batch.response_starts))]
        step = TeacherStep([teacher], local_host(VOCAB))
        with pytest.raises(ValueError, match=refused(1, f"topk_ids holds id {int(good.topk_ids[1][0, 0])} twice in "
                                                        "row 0", "slime's train_metadata['megatron_rl_patches_teacher_"
                                                                 "rows'], carried from the rollout")):
            add_carried(step, batch, None, {CARRIED: carried})


@pytest.mark.parametrize("field", ["token_log_probs", "topk_ids", "topk_log_probs", "tail_log_probs"])
def test_rows_on_the_meta_device_are_a_named_refusal(field):
    batch, good = samples(), rows_of(samples())
    bad = one_sample_changed(good, 2, **{field: lambda t: t.to("meta")})
    with ServedTeacher(DEAD, top_k=K) as teacher:
        with pytest.raises(ValueError, match=refused(2, f"{field} is on the meta device (a shape without data): give "
                                                        "the values themselves")):
            TeacherStep([teacher], local_host(VOCAB)).add(batch, scored={0: bad})
        before = ScoredBefore([(ids_digest(ids, start), one_sample(bad, i)) for i, (ids, start) in enumerate(
            zip(batch.sequences, batch.response_starts))])
        with pytest.raises(ValueError, match=refused(2, f"{field} is on the meta device")):
            TeacherStep([teacher], local_host(VOCAB)).add(batch, scored={0: before})


def test_hidden_states_on_the_meta_device_are_a_named_refusal():
    batch = samples()
    with ServedTeacher(DEAD, head=head(), top_k=3) as teacher:
        states = [torch.zeros(batch.response_rows(i), H, dtype=teacher.hidden_dtype) for i in range(3)]
        states[1] = states[1].to("meta")
        with pytest.raises(ValueError, match=refused(1, "the hidden states are on the meta device (a shape without "
                                                        "data)")):
            TeacherStep([teacher], local_host(VOCAB)).add(batch, scored={0: states})


@pytest.mark.parametrize("chunk", [1, 4, 5, 1000])
def test_rows_checked_in_chunks_name_the_wrong_sample_in_any_chunk(monkeypatch, chunk):
    """The values are checked a chunk of samples at a time (`CHUNK_ROWS` rows): a wrong sample in any
    chunk is the one named, and right rows pass in every split."""
    from megatron_rl_patches.teachers.step import given_rows

    monkeypatch.setattr(given_rows, "CHUNK_ROWS", chunk)
    batch, good = samples(), rows_of(samples())  # 4, 3 and 5 response rows
    with ServedTeacher(DEAD, top_k=K) as teacher:
        step = TeacherStep([teacher], local_host(VOCAB))
        step.add(batch, scored={0: good})
        step.collect()
        for sample in range(3):
            bad = one_sample_changed(good, sample, topk_ids=twice(1))
            repeated = int(good.topk_ids[sample][1, 0])
            with pytest.raises(ValueError, match=refused(sample, f"topk_ids holds id {repeated} twice in row 1")):
                TeacherStep([teacher], local_host(VOCAB)).add(batch, scored={0: bad})
    assert [list(part) for part in given_rows.row_chunks(batch, 0, 3)] == \
        {1: [[0], [1], [2]], 4: [[0], [1, 2]], 5: [[0, 1], [2]], 1000: [[0, 1, 2]]}[chunk]


def outside_rows(token_probability: float) -> tuple[TeacherBatch, BatchScores]:
    """One sample of 3 rows whose actual token (11) is none of the top-K (ids 0..K-1, a mass of 0.75:
    the tail log 0.25), scored at `token_probability` on row 1 (the others at 0.05)."""
    batch = TeacherBatch([torch.tensor([11, 11, 11, 11])], [1])
    values = torch.log(torch.full((3, K), 0.75 / K, dtype=torch.float64))
    token = torch.log(torch.tensor([0.05, token_probability, 0.05], dtype=torch.float64))
    return batch, BatchScores([token], [torch.arange(K).expand(3, K).clone()], [values], [tail_log_probs(values)])


def test_a_token_outside_the_top_k_above_its_rows_tail_is_refused_on_every_way_in():
    """Issue 110 item 6: a token none of the top-k is part of the tail's mass, so its probability is
    at most the tail's (within the reply slack, 1e-3): log 0.9 beside a tail of log 0.25 was read as
    the teacher's scores; it is refused naming the teacher, the sample and the rule, whether given to
    `add(scored=)`, as a `ScoredBefore` or as slime's carried rows."""
    batch, bad = outside_rows(0.9)
    rule = ("token_log_probs is above its row's tail in row 1: id 11, none of the top-k, scores e^-0.1054 = 0.9 "
            "beside a tail of e^-1.386 = 0.25, beyond 0.001 (a token outside the top-k is part of the tail's mass)")
    with ServedTeacher(DEAD, top_k=K) as teacher:
        with pytest.raises(ValueError, match=refused(0, rule)):
            TeacherStep([teacher], local_host(VOCAB)).add(batch, scored={0: bad})
        before = ScoredBefore([(ids_digest(batch.sequences[0], 1), bad)], origin="a test's rollout", vocab_size=VOCAB)
        with pytest.raises(ValueError, match=refused(0, rule, "a test's rollout")):
            TeacherStep([teacher], local_host(VOCAB)).add(batch, scored={0: before})
        carried = [{teacher_key(teacher, None): packed(bad, batch)}]
        with pytest.raises(ValueError, match=refused(0, rule, "slime's train_metadata['megatron_rl_patches_teacher_"
                                                              "rows'], carried from the rollout")):
            add_carried(TeacherStep([teacher], local_host(VOCAB)), batch, None, {CARRIED: carried})


@pytest.mark.parametrize(("probability", "read"), [(0.25, True), (0.25 + 9e-4, True), (0.25 + 2e-3, False),
                                                   (0.0, True), (0.26, False)])
def test_a_token_outside_the_top_k_is_read_up_to_its_tail_within_the_slack(probability, read):
    batch, rows = outside_rows(probability)
    with ServedTeacher(DEAD, top_k=K) as teacher:
        step = TeacherStep([teacher], local_host(VOCAB))
        if read:
            step.add(batch, scored={0: rows})
            (got,) = step.collect()
            assert torch.equal(got.token_log_probs[0], rows.token_log_probs[0])
        else:
            with pytest.raises(ValueError, match=r"token_log_probs is above its row's tail in row 1"):
                step.add(batch, scored={0: rows})
