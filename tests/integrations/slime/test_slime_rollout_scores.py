"""slime's served teachers asked at the rollout (issue 88 item 2, `MEGATRON_RL_PATCHES_OPD_SCORE_AT`,
integrations/slime/rollout_scores.py and integrations/megatron/opd/carried_rows.py), without
slime: samples shaped as slime's `Sample` (tokens, response_length, train_metadata, status) go
through the rollout hook against a local server that answers as vLLM does, each as an asyncio
task (a held sample does not hold the others back), their rows put in their train_metadata; on
the training side the rows are taken off the split's carried keys and handed to the teacher step
unasked where their digest is the batch's (the scores the step would have asked for), a stale or
missing one asked again; a failure is the teacher's named error; the rollout's figures join
slime's rollout metrics as teacher/... keys; the holder on slime's args pickles empty. slime's real
rollout and train_actor: tests/integrations/slime/lane/test_slime_opd_rollout_scores_lane.py."""
from __future__ import annotations

import asyncio
import logging
import pickle
import re
import threading
import types

import pytest
import torch

from megatron_rl_patches.integrations.megatron.opd import rollout_teachers
from megatron_rl_patches.integrations.megatron.opd.carried_rows import (
    CARRIED,
    ROWS,
    add_carried,
    take_rows,
    teacher_key,
)
from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS
from megatron_rl_patches.integrations.slime import rollout_scores
from megatron_rl_patches.teachers import ServedTeacher, ServedTeacherError, TeacherBatch, TeacherStep, local_host
from tests.teachers.local_servers import completions, dies_after, held, url_of, vllm_like

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

K = 4
SEQUENCES = ([5, 9, 2, 7, 11], [3, 8, 1], [6, 4, 10, 2, 3, 3])
RESPONSES = (3, 2, 2)


def sample(index: int, **meta) -> types.SimpleNamespace:
    """A sample as slime's rollout hands it to its hooks (the fields the hook reads)."""
    return types.SimpleNamespace(index=index, tokens=list(SEQUENCES[index]), response_length=RESPONSES[index],
                                 train_metadata=dict(meta) or None, status=types.SimpleNamespace(name="COMPLETED"))


def slime_args() -> types.SimpleNamespace:
    return types.SimpleNamespace(rollout_sample_hook_path=None, hf_checkpoint=None)


@pytest.fixture
def teachers_at(monkeypatch):
    def at(url: str, where: str | None = "rollout", context: str | None = None) -> None:
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", f"{url};engine=vllm" + (f";context={context}"
                                                                                         if context else ""))
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_K", str(K))
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_IDS_FROM", "teacher")
        if where is None:
            monkeypatch.delenv("MEGATRON_RL_PATCHES_OPD_SCORE_AT", raising=False)
        else:
            monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_SCORE_AT", where)
    return at


def rollout(args, samples) -> None:
    """The samples' hooks run as slime runs them: one asyncio task per sample."""
    async def all_of() -> None:
        await asyncio.gather(*(rollout_scores.score_sample(args, s) for s in samples))
    asyncio.run(all_of())


def training_data(samples) -> dict:
    """A training rank's rollout data as slime's split leaves it (the carried keys under CONTEXTS)."""
    return {"tokens": [torch.tensor(s.tokens) for s in samples],
            "response_lengths": [s.response_length for s in samples],
            CONTEXTS: [{key: meta[key] for key in (ROWS,) if key in meta} for meta in
                       (s.train_metadata or {} for s in samples)]}


def test_the_setting_and_the_entries_it_takes(teachers_at):
    assert rollout_teachers.score_at({}) == "train" and \
        rollout_teachers.score_at({rollout_teachers.SCORE_AT: "Rollout"}) == "rollout"
    with pytest.raises(ValueError, match=r"MEGATRON_RL_PATCHES_OPD_SCORE_AT='later': use rollout .* or train"):
        rollout_teachers.score_at({rollout_teachers.SCORE_AT: "later"})
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings

    teachers_at("http://127.0.0.1:9")
    assert len(rollout_teachers.rollout_entries(opd_settings())) == 1
    assert rollout_teachers.carried_keys(opd_settings()) == [ROWS]
    for where in ("train", None):  # None: unset, the default (train)
        teachers_at("http://127.0.0.1:9", where=where)
        assert rollout_teachers.rollout_entries(opd_settings()) == [] and \
            rollout_teachers.carried_keys(opd_settings()) == []
        assert rollout_scores.rollout_teachers(slime_args()) is None


def test_each_sample_scored_as_its_generation_ends_and_read_by_the_train_step_unasked(teachers_at):
    release = threading.Event()
    first = [True]

    def first_held(body):  # the first sample's answer held until the others are in
        if first[0] and len(body["prompt"]) == len(SEQUENCES[0]):
            first[0] = False
            return held(release, seconds=20)(body)
        return completions(body)

    with vllm_like(v1_completions=first_held) as server:
        teachers_at(url_of(server))
        args, samples = slime_args(), [sample(i) for i in range(3)]

        async def watched() -> list[int]:
            done: list[int] = []

            async def one(s):
                await rollout_scores.score_sample(args, s)
                done.append(s.index)
            tasks = [asyncio.create_task(one(s)) for s in samples]
            while len(done) < 2:
                await asyncio.sleep(0.01)
            release.set()
            await asyncio.gather(*tasks)
            return done

        order = asyncio.run(watched())
        held_teachers = rollout_scores.rollout_teachers(args)
        figures = held_teachers.metrics()
        asked = server.answered("/v1/completions")
        with ServedTeacher(url_of(server), "vllm", top_k=K) as served:
            data = training_data(samples)
            take_rows(data)
            assert CONTEXTS not in data and len(data[CARRIED]) == 3  # nothing else was carried
            step = TeacherStep([served], local_host(12))
            batch = TeacherBatch([torch.tensor(s) for s in SEQUENCES],
                                 [len(s) - r for s, r in zip(SEQUENCES, RESPONSES)])
            assert add_carried(step, batch, None, data)
            (carried,) = step.collect()
            read = step.metrics()
            assert server.answered("/v1/completions") == asked  # the train step asked nothing
            step.send(batch)
            (fresh,) = step.collect()
        held_teachers.close()
    assert order[-1] == 0  # the held sample did not hold the other two back
    assert all(set(s.train_metadata[ROWS]) == {teacher_key(served, served.context)} for s in samples)
    assert (figures["samples"], figures["teachers"][0]["samples"]) == (3, 3) and figures["hook_wait_s"] > 0
    assert (read["samples"], read["scored_before"]) == (3, 3) and read["collect_wait_s"] < 0.5
    for got, want in ((carried.topk_ids, fresh.topk_ids), (carried.topk_log_probs, fresh.topk_log_probs),
                      (carried.tail_log_probs, fresh.tail_log_probs)):
        assert all(torch.equal(a, b.to(a.dtype)) if a.dtype == torch.int64 else
                   torch.equal(a.float(), b.float()) for a, b in zip(got, want))


def test_a_stale_or_missing_row_is_asked_again_at_the_train_step(teachers_at):
    with vllm_like() as server:
        teachers_at(url_of(server))
        args, samples = slime_args(), [sample(i) for i in range(3)]
        rollout(args, samples[:2])  # sample 2 never went through the hook (no rows)
        samples[1].tokens[-1] = 0  # and sample 1 changed after its rows were made (a stale digest)
        samples[2].train_metadata = {}
        with ServedTeacher(url_of(server), "vllm", top_k=K) as served:
            served.check()  # its probe of K
            before = server.answered("/v1/completions")
            data = training_data(samples)
            take_rows(data)
            step = TeacherStep([served], local_host(12))
            batch = TeacherBatch([torch.tensor(s.tokens) for s in samples],
                                 [len(s.tokens) - s.response_length for s in samples])
            assert add_carried(step, batch, None, data)
            (scores,) = step.collect()
            figures = step.metrics()
        rollout_scores.rollout_teachers(args).close()
    assert server.answered("/v1/completions") == before + 2 and len(scores) == 3
    assert (figures["adds"], figures["scored_before"]) == (1, 1)  # one part: sample 0 carried, samples 1-2 asked


def test_a_privileged_context_is_scored_before_the_response_and_checked_on_arrival(teachers_at):
    with vllm_like() as server:
        teachers_at(url_of(server), context="hint")
        args, samples = slime_args(), [sample(0, hint=[7, 7]), sample(1, hint=[8])]
        rollout(args, samples)
        prompts = [body["prompt"] for path, body in server.bodies if path == "/v1/completions"][-2:]
        with ServedTeacher(url_of(server), "vllm", top_k=K, context="hint") as served:
            served.check()  # its probe of K
            data = training_data(samples)
            take_rows(data)
            step = TeacherStep([served], local_host(12))
            batch = TeacherBatch([torch.tensor(s.tokens) for s in samples], [2, 1])
            before = server.answered("/v1/completions")
            assert add_carried(step, batch, [{"hint": [7, 7]}, {"hint": [8]}], data)
            step.collect()
            assert server.answered("/v1/completions") == before  # carried: the contexts' digests matched
            assert add_carried(step, batch, [{"hint": [7, 7]}, {"hint": [9]}], data)  # another context: asked
            step.collect()
            assert server.answered("/v1/completions") == before + 1
        rollout_scores.rollout_teachers(args).close()
    assert sorted(prompts) == sorted([[7, 7, *SEQUENCES[0][2:]], [8, *SEQUENCES[1][1:]]])


def test_a_failing_teacher_fails_the_rollout_with_its_named_error(teachers_at):
    with vllm_like(v1_completions=lambda body: (500, {"detail": "engine died"})) as server:
        teachers_at(url_of(server))
        args = slime_args()
        with pytest.raises(ServedTeacherError, match=url_of(server)):
            rollout(args, [sample(0)])
        rollout_scores.rollout_teachers(args).close()


def test_an_evaluation_an_aborted_sample_and_the_train_setting_are_left_alone(teachers_at):
    with vllm_like() as server:
        teachers_at(url_of(server))
        args = slime_args()
        evaluated, aborted = sample(0), sample(1)
        aborted.status = types.SimpleNamespace(name="ABORTED")
        asyncio.run(rollout_scores.score_sample(args, evaluated, evaluation=True))
        asyncio.run(rollout_scores.score_sample(args, aborted))
        teachers_at(url_of(server), where="train")
        other = slime_args()
        trained = sample(2)
        asyncio.run(rollout_scores.score_sample(other, trained))
        rollout_scores.rollout_teachers(args).close()
        assert server.answered("/v1/completions") == 0
    assert evaluated.train_metadata is None and trained.train_metadata is None
    assert aborted.train_metadata is None


def test_slimes_hook_call_runs_it_and_its_metrics_get_the_teachers_figures(teachers_at):
    with vllm_like() as server:
        teachers_at(url_of(server))
        args, one = slime_args(), sample(0)

        async def slimes_hooks(args, value, **kwargs):  # slime's apply_rollout_sample_hooks with no hook named
            return value
        got = asyncio.run(rollout_scores.hooks_wrapper(slimes_hooks, None, (args, one), {"evaluation": False}))
        assert got is one and ROWS in one.train_metadata
        args.rollout_sample_hook_path = [rollout_scores.HOOK]  # named by hand: slime runs it, not twice
        again = sample(1)
        asyncio.run(rollout_scores.hooks_wrapper(slimes_hooks, None, (args, again), {}))
        assert again.train_metadata is None

        def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
            return rollout_extra_metrics
        logged = rollout_scores.log_rollout_data_wrapper(log_rollout_data, None, (0, args, [one], {"x": 1.0}, 2.0), {})
        rollout_scores.rollout_teachers(args).close()
    assert logged["x"] == 1.0 and logged["teacher/samples"] == 1 and logged["teacher/bytes"] > 0
    where = url_of(server).split("://")[1]
    assert logged[f"teacher/replica/{where}/latency_p50_s"] > 0 and logged["teacher/taken_out"] == 0
    shipped = pickle.loads(pickle.dumps(args))  # slime's args travel between processes: the teachers do not
    assert getattr(shipped, rollout_scores.ATTRIBUTE) is None


def test_a_replica_killed_during_the_rollout_is_one_warning_and_in_the_rollout_metrics(teachers_at, caplog):
    from megatron_rl_patches.teachers import ClientSettings, ReplicaSettings

    with vllm_like() as a, vllm_like(v1_completions=dies_after(2)) as b:
        teachers_at(f"{url_of(a)}|{url_of(b)}")
        args = slime_args()
        held_teachers = rollout_scores.rollout_teachers(args)
        held_teachers.close()  # the entry's teacher, with quick retries and no hedging (b's failure not hidden)
        held_teachers.teachers = [ServedTeacher([url_of(a), url_of(b)], top_k=K,
                                                client=ClientSettings(retries=1, backoff_s=0.01, deadline_s=20.0),
                                                replicas=ReplicaSettings(hedge_after=None))]
        held_teachers.teachers[0].check()
        with caplog.at_level(logging.WARNING, logger="megatron_rl_patches.teachers.served"):
            rollout(args, [sample(i % 3) for i in range(8)])
        figures = held_teachers.metrics()
        held_teachers.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and url_of(b) in r.getMessage()]
    assert len(warned) == 1 and "taken out" in warned[0], warned
    assert figures["taken_out"] == [url_of(b)] and figures["samples"] == 8 and figures["failovers"] >= 1


def test_slimes_split_carries_the_rows_and_its_metrics_never_see_them(teachers_at):
    from megatron_rl_patches.integrations.megatron.opd.topk_request import FIGURES
    from megatron_rl_patches.integrations.slime import contexts, opd
    from tests.integrations.slime.test_slime_contexts import split_like_slime

    rows = {"abc": {"digest": [3, 1, 0]}}
    data = {"tokens": [[1, 2], [3], [4, 5]], "metadata": [{ROWS: rows, "x": 1}, {}, None]}

    def split(data):
        return split_like_slime(data, [[0, 2], [1]])

    teachers_at("http://127.0.0.1:9")
    ranks = contexts.split_wrapper(split, None, (data,), {})
    assert ranks[0][CONTEXTS] == [{ROWS: rows}, {}] and ranks[1][CONTEXTS] == [{}]
    take_rows(ranks[0])
    assert ranks[0][CARRIED] == [rows, None] and CONTEXTS not in ranks[0]
    teachers_at("http://127.0.0.1:9", where="train")  # asked by the train step: nothing carried
    assert all(CONTEXTS not in rank for rank in contexts.split_wrapper(split, None, (data,), {}))

    def log_rollout_data(rollout_id, args, rollout_data):
        return sorted(rollout_data)
    seen = opd.log_rollout_data_wrapper(log_rollout_data, None, (0, None, {**ranks[0], FIGURES: None}), {})
    assert CARRIED not in seen and FIGURES not in seen


def rollout_sample(index: int, tokens: list[int], response: int, **meta) -> types.SimpleNamespace:
    return types.SimpleNamespace(index=index, tokens=tokens, response_length=response, train_metadata=dict(meta),
                                 status=types.SimpleNamespace(name="COMPLETED"))


HOOK_WORDS = "slime_opd (the rollout's sample hook, score_sample)"


@pytest.mark.parametrize(("tokens", "response", "meta", "error", "words"), [
    (list(range(2, 72)), 3, {}, ServedTeacherError,
     f"{HOOK_WORDS}: sample 37 has 70 ids, over "),  # the server's max model length is 64
    ([5, 9, 2, 7, 11], 3, {"hint": [1.5, 2.0]}, TypeError,
     f"{HOOK_WORDS}: sample 37's train_metadata['hint'] must be text or token ids"),
    ([5, 9, 2, 7, 11], 3, {"hint": []}, ValueError, f"{HOOK_WORDS}: sample 37's train_metadata['hint'] holds no ids"),
    ([5, 9, 2, 7, 11], 3, {"hint": [4, -2]}, ValueError,
     f"{HOOK_WORDS}: sample 37's train_metadata['hint'] holds a negative id (-2)"),
    ([5, 9, 2, 7, 11], 9, {"hint": [4]}, ValueError,
     f"{HOOK_WORDS}: sample 37's response_length 9 is not within its 5 tokens"),
], ids=["too-long", "float-context", "empty-context", "negative-context", "response-past-tokens"])
def test_a_rollout_failure_names_the_rollouts_sample_and_where_it_was_asked(teachers_at, tokens, response, meta,
                                                                           error, words):
    """Issue 96 item 4: the sample's rollout index (not its place, 0, in the one-sample batch) and the
    rollout's hook (not TeacherStep.send)."""
    with vllm_like() as server:
        teachers_at(url_of(server), context="hint" if meta else None)
        args = slime_args()
        with pytest.raises(error) as caught:
            asyncio.run(rollout_scores.score_sample(args, rollout_sample(37, tokens, response, **meta)))
        rollout_scores.rollout_teachers(args).close()
        sent = [body["prompt"] for path, body in server.bodies if path == "/v1/completions"]
    message = str(caught.value)
    assert message.startswith(words) and "sample 0" not in message and "TeacherStep" not in message, message
    assert tokens not in sent  # refused before it was sent
    if error is ServedTeacherError:
        assert caught.value.sample == 37


def test_a_context_id_past_the_teachers_vocabulary_is_refused_before_the_rollout_sends_it(monkeypatch):
    """Issue 96 item 5: `;same_tokenizer;vocab=512;context=ctx` with train_metadata['ctx'] = [3, 612]
    refused as the train step refuses it (the sample, the key), nothing sent; an id inside is sent."""
    with vllm_like() as server:
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", f"{url_of(server)};engine=vllm;same_tokenizer;"
                                                               "vocab=512;context=ctx")
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_K", str(K))
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_IDS_FROM", "teacher")
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_SCORE_AT", "rollout")
        args = slime_args()
        with pytest.raises(ValueError, match=re.escape(
                f"{HOOK_WORDS}: sample 37's train_metadata['ctx'] holds id 612, past the teacher's vocabulary of 512")):
            asyncio.run(rollout_scores.score_sample(args, rollout_sample(37, [5, 9, 2, 7, 11], 3, ctx=[3, 612])))
        sent = [body["prompt"] for path, body in server.bodies if path == "/v1/completions"]
        inside = rollout_sample(38, [5, 9, 2, 7, 11], 3, ctx=[3, 511])
        asyncio.run(rollout_scores.score_sample(args, inside))
        rollout_scores.rollout_teachers(args).close()
    assert not any(612 in prompt for prompt in sent)
    assert ROWS in inside.train_metadata


def cut_rows(entry: dict) -> dict:
    return {**entry, **{name: entry[name][:1] for name in ("ids", "values", "tails", "token")}}


def with_value(name: str, value: float):
    def put(entry: dict) -> dict:
        changed = entry[name].clone()
        changed.view(-1)[0] = value
        return {**entry, name: changed}
    return put


def carried_refusal(teachers_at, change) -> tuple[str, str, int]:
    """Two samples scored at the rollout, sample 1's carried entry changed by `change`, handed to the
    train step: the ValueError's words, the entry's key and the requests the step made."""
    with vllm_like() as server:
        teachers_at(url_of(server))
        args, samples = slime_args(), [sample(i) for i in range(2)]
        rollout(args, samples)
        (key,) = samples[1].train_metadata[ROWS]
        samples[1].train_metadata[ROWS][key] = change(samples[1].train_metadata[ROWS][key])
        with ServedTeacher(url_of(server), "vllm", top_k=K) as served:
            data = training_data(samples)
            take_rows(data)
            step = TeacherStep([served], local_host(12))
            batch = TeacherBatch([torch.tensor(s.tokens) for s in samples],
                                 [len(s.tokens) - s.response_length for s in samples])
            before = server.answered("/v1/completions")
            with pytest.raises(ValueError) as caught:
                add_carried(step, batch, None, data)
            asked = server.answered("/v1/completions") - before
        rollout_scores.rollout_teachers(args).close()
    return str(caught.value), key, asked


@pytest.mark.parametrize(("corrupt", "words"), [
    (cut_rows, "token_log_probs is of shape (1,) and dtype torch.float64, not (2,) and torch.float64"),
    (with_value("ids", -3), "topk_ids holds a negative id (-3)"),
    (with_value("ids", 12), "topk_ids holds id 12, past the vocabulary of 12"),
    (with_value("values", float("nan")), "are no log-probabilities (a NaN log-prob)"),
    (with_value("values", 0.7), "are no log-probabilities (a top-k mass or log-prob of e^"),
], ids=["rows-cut", "negative-id", "id-past-the-vocabulary", "nan", "plus-0.7"])
def test_carried_rows_that_a_served_reply_could_not_hold_are_refused_naming_the_sample_and_field(teachers_at, corrupt,
                                                                                                 words):
    """Issue 96 item 1: a carried row whose digest matches is read only if it holds what the
    teacher would have sent; else refused naming the sample and the train_metadata field."""
    message, _, asked = carried_refusal(teachers_at, corrupt)
    assert message.startswith(
        f"TeacherStep.add: teacher 0's rows of sample 1 (slime's train_metadata[{ROWS!r}], carried from the rollout) "
        "are not what the served teacher answers: "), message
    assert words in message and asked == 0


@pytest.mark.parametrize(("entry", "words"), [
    (lambda e: {**e, "digest": "abc"}, "holds a digest 'abc' that is not three ints (ids_digest)"),
    (lambda e: {name: v for name, v in e.items() if name != "values"}, "has no 'values'"),
    (lambda e: "rows", "is a str, not a mapping of digest, ids, values, tails and token"),
    (lambda e: {**e, "ids": e["ids"].float()}, "holds ids of dtype torch.float32 (integer ids expected)"),
    (lambda e: {**e, "tails": ["a"]}, "holds tails that are no tensor (a list)"),
], ids=["digest-abc", "no-values", "a-string", "float-ids", "text-tails"])
def test_a_malformed_carried_entry_is_a_named_error(teachers_at, entry, words):
    """Issue 96 item 2: no bare ValueError / KeyError / TypeError from int(), a dict or torch."""
    message, key, asked = carried_refusal(teachers_at, entry)
    assert message.startswith(f"slime_opd: sample 1's train_metadata[{ROWS!r}][{key!r}] {words}: it is not what the "
                              "rollout's hook writes"), message
    assert asked == 0
