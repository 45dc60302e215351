"""The public teacher step (`TeacherStep` behind a host) in a real 2-rank gloo world against a small
local server that answers as vLLM does: the served teacher asked once per sharing group (the
server counts the requests: none from the second rank), the same scores on both ranks, a failure on
the asking rank (or an in-process teacher's on the other) raised alike on both; ranks holding
different teachers (URL, context key; for `ServedTeacher.score(batch, group=...)` also top-k and
head) refused alike on both before anything is asked, replicas listed in another order accepted;
without torch.distributed (local_host) the step scores in place; bad arguments refused."""
from __future__ import annotations

import json
import math
import time

import pytest
import torch

from megatron_rl_patches.teachers import (
    BatchScores,
    LoopHost,
    ServedTeacher,
    ServedTeacherError,
    ServedTeacherRefusal,
    StepPlan,
    TeacherBatch,
    TeacherHead,
    TeacherStep,
    agree_failure,
    build_teachers,
    local_host,
)
from megatron_rl_patches.teachers.served.hidden_states import head_scores
from megatron_rl_patches.teachers.step.teacher_step import join_build
from megatron_rl_patches.testing.multirank import run_multirank
from tests.teachers.local_servers import MAX_MODEL_LEN, url_of, vllm_like

K = 4
SEQUENCES = ([5, 9, 2, 7, 11], [3, 8, 1], [6, 4, 10, 2])
STARTS = [2, 1, 3]


def batch(too_long: bool = False) -> TeacherBatch:
    sequences = [torch.tensor(ids) for ids in SEQUENCES]
    if too_long:
        sequences[1] = torch.arange(MAX_MODEL_LEN + 5) % 12
    return TeacherBatch(sequences, STARTS)


class RankTeacher:
    """An in-process teacher: every rank scores (row r: the ranks 0..K-1 at 1/2, 1/4, ...); with
    `fail_on` it raises on that rank."""

    top_k = K

    def __init__(self, rank: int, fail_on: int | None = None) -> None:
        self.rank, self.fail_on, self.calls = rank, fail_on, 0

    def score(self, samples: TeacherBatch) -> BatchScores:
        self.calls += 1
        if self.rank == self.fail_on:
            raise RuntimeError(f"in-process teacher broke on rank {self.rank}")
        rows = [samples.response_rows(i) for i in range(len(samples))]
        logp = torch.tensor([-(i + 1) * math.log(2.0) for i in range(K)], dtype=torch.float64)
        return BatchScores([torch.zeros(r, dtype=torch.float64) for r in rows],
                           [torch.arange(K).expand(r, K).clone() for r in rows],
                           [logp.expand(r, K).clone() for r in rows],
                           [torch.full((r,), math.log(1 - logp.exp().sum().item()), dtype=torch.float64) for r in rows])


def flat(scores: BatchScores) -> list[list[float]]:
    return [torch.cat([t.double().flatten() for t in part]).tolist()
            for part in (scores.token_log_probs, scores.topk_ids, scores.topk_log_probs, scores.tail_log_probs)]


def failure(step: TeacherStep, samples: TeacherBatch) -> tuple[str, str]:
    step.send(samples)
    try:
        step.collect()
    except (ServedTeacherError, ServedTeacherRefusal) as error:
        return type(error).__name__, str(error)
    return "", "no error"


def rank_steps(rank: int, world_size: int, url: str) -> dict:
    import torch.distributed as dist

    host = LoopHost(vocab_size=12, share_group=dist.group.WORLD, job_group=dist.group.WORLD)
    out: dict = {}
    with ServedTeacher(url, "vllm", top_k=K) as served:
        step = TeacherStep([served, RankTeacher(rank)], host)
        out["asks"] = step.asks()
        step.send(batch())
        out["scores"] = [flat(scores) for scores in step.collect()]
        step.metrics()
        # the same samples added in parts, split differently on each rank (the joined batch is what is compared)
        whole = batch()
        cut = ((0, 1, 3), (0, 2, 3))[rank]
        for lo, hi in zip(cut, cut[1:]):
            step.add(TeacherBatch(whole.sequences[lo:hi], whole.response_starts[lo:hi]))
        out["added"] = [flat(scores) for scores in step.collect()]
        figures = step.metrics()
        out["metrics"] = {name: figures[name] for name in ("samples", "rows", "adds", "collects")}
        out["served_samples"] = figures["teachers"][0]["samples"]
        out["refused"] = failure(TeacherStep([served], host), batch(too_long=True))
        out["broken"] = failure(TeacherStep([served, RankTeacher(rank, fail_on=1)], host), batch())
    # built from an entry through its kind: connected by the asking rank only; its bad vocabulary
    # (rank 0's entry names 5 ids, the student writes 12) the same error on both ranks
    (built,) = build_teachers(f"{url};engine=vllm;same_tokenizer;vocab=12", host, top_k=K)
    built.close()
    try:
        build_teachers(f"{url};engine=vllm;same_tokenizer;vocab={5 if rank == 0 else 12}", host, top_k=K)
        out["bad_vocab"] = "no error"
    except ValueError as error:
        out["bad_vocab"] = str(error)
    return out


def raised(call) -> tuple[str, str]:
    """(the error's type, its text) from `call()`, or ("", "no error")."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - compared between the ranks
        return type(error).__name__, str(error)
    return "", "no error"


def one_rank_wrong(rank: int, world_size: int, url: str, other: str, names: tuple[str, ...] | None = None) -> dict:
    """Each case: one rank's bad call (or a host, or a teacher, that differs between the ranks)
    beside the other's good one; every rank must raise the same error at once, none left waiting
    in a collective (`other`: a second server's URL)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    host = LoopHost(vocab_size=12, share_group=world, job_group=world)
    lone = dist.new_group([1])  # every rank creates it; only rank 1 is in it
    out: dict = {}
    entry = f"{url};engine=vllm;same_tokenizer;vocab=12"
    with ServedTeacher(url, "vllm", top_k=K) as served:
        def step_of(wrong_host: LoopHost | None = None, plan: StepPlan | None = None) -> TeacherStep:
            return TeacherStep([served], wrong_host if rank == 1 and wrong_host else host, plan if rank == 1 else None)

        def collect_unsent() -> None:
            step = step_of()
            if rank == 0:
                step.send(batch())
            step.collect()

        def send_not_a_batch() -> None:
            step = step_of()
            step.send(batch() if rank == 0 else "not a batch")
            step.collect()

        def sent_twice() -> None:
            step = step_of()
            step.send(batch())
            if rank == 1:
                step.send(batch())
            step.collect()

        def added_differs() -> None:  # add: the joined parts compared (rank 1 left sample 2 out)
            step = step_of()
            step.add(TeacherBatch(list(batch().sequences[:1]), STARTS[:1]))
            step.add(TeacherBatch(list(batch().sequences[1:3 if rank == 0 else 2]), STARTS[1:3 if rank == 0 else 2]))
            step.collect()

        def add_not_a_batch() -> None:
            step = step_of()
            step.add(batch())
            step.add(batch() if rank == 0 else "not a batch")
            step.collect()

        def batch_differs() -> None:  # the second rank would read the first's scores as its own
            step = step_of()
            step.send(batch() if rank == 0 else TeacherBatch([ids + 1 for ids in batch().sequences], STARTS))
            step.collect()

        def projected_differs() -> None:
            step = step_of()
            step.send(batch())
            step.collect(projected=rank == 0)

        def used(step: TeacherStep) -> None:
            step.send(batch())
            step.collect()

        def joined() -> None:  # rank 1 holds no step (slime's earlier stages): it joins the build and the collect
            alone = LoopHost(vocab_size=12, share_group=None, job_group=world)
            if rank == 1:
                join_build(alone)
                agree_failure(None, world)
                return
            used(TeacherStep([served], alone))

        def unjoined() -> None:  # rank 1 skips the build (no join_build): told, not left behind
            if rank == 1:
                agree_failure(None, world)
                return
            TeacherStep([served], LoopHost(vocab_size=12, share_group=None, job_group=world))

        def steps_after() -> None:  # a refused step leaves nothing behind: the next one scores
            step = step_of()
            step.send(batch() if rank == 0 else "not a batch")
            raised(step.collect)
            step.send(batch())
            step.collect()

        def with_teacher(call, url_0: str = url, url_1: str = url, **options) -> None:
            """`call(teacher)` with rank 0's teacher at `url_0`, rank 1's at `url_1` (`options`: (rank 0's
            value, rank 1's) per keyword)."""
            mine = {name: values[rank] for name, values in options.items()}
            with ServedTeacher(url_0 if rank == 0 else url_1, "vllm", **{"top_k": K, **mine}) as teacher:
                call(teacher)

        def step_with(teacher: ServedTeacher) -> None:  # without an identity check rank 1 reads rank 0's scores
            step = TeacherStep([teacher], host)
            step.send(batch(), contexts={"hint": [[1], [2], [3]], "other": [[4], [5], [6]]})
            step.collect()

        def scored(teacher: ServedTeacher) -> None:  # without an identity check each rank its own teacher's scores
            teacher.score(batch(), group=world)

        def given_rows_differ() -> None:  # rank 1's given rows hold a NaN (issue 96 item 1): refused on both ranks
            import dataclasses

            step = step_of()
            given = served.score(batch())
            if rank == 1:
                values = [v.clone() for v in given.topk_log_probs]
                values[2][0, 0] = float("nan")
                given = dataclasses.replace(given, topk_log_probs=values)
            step.add(batch(), scored={0: given})
            step.collect()

        def given_rows_meta() -> None:  # rank 1's given rows on the meta device (issue 105 item 4): named, on both
            import dataclasses

            step = step_of()
            given = served.score(batch())
            if rank == 1:
                given = dataclasses.replace(given, tail_log_probs=[t.to("meta") for t in given.tail_log_probs])
            step.add(batch(), scored={0: given})
            step.collect()

        def carried_malformed() -> None:  # rank 1's carried entry is a string (item 2): refused on both ranks
            from megatron_rl_patches.integrations.megatron.opd.carried_rows import CARRIED, add_carried, teacher_key

            step = step_of()
            entry = {teacher_key(served, None): "rows"} if rank == 1 else None
            if not add_carried(step, batch(), None, {CARRIED: [None, entry, None]}):
                step.send(batch())
            step.collect()

        cases = {
            "given_rows_differ": given_rows_differ,
            "given_rows_meta": given_rows_meta,
            "carried_malformed": carried_malformed,
            "collect_unsent": collect_unsent,
            "send_not_a_batch": send_not_a_batch,
            "sent_twice": sent_twice,
            "projected_differs": projected_differs,
            "batch_differs": batch_differs,
            "added_differs": added_differs,
            "add_not_a_batch": add_not_a_batch,
            "bad_plan": lambda: step_of(plan=StepPlan(8)),
            "steps_after": steps_after,
            "joined": joined,
            "unjoined": unjoined,
            # build_teachers: its checks agreed over the job before the asking rank connects
            "build_bad_top_k": lambda: build_teachers(entry, host, top_k=0 if rank == 1 else K),
            "build_entries_differ": lambda: build_teachers(entry if rank == 1 else f"{entry},{entry}", host, top_k=K),
            "build_unprobed": lambda: build_teachers(entry if rank == 0 else f"{url};engine=vllm", host, top_k=K),
            "joined_but_shared": lambda: used(step_of()) if rank == 0 else join_build(host),
            "share_none": lambda: used(step_of(LoopHost(vocab_size=12, share_group=None, job_group=world))),
            "share_apart": lambda: used(step_of(LoopHost(vocab_size=12, share_group=lone, job_group=world))),
            "vocab_differs": lambda: used(step_of(LoopHost(vocab_size=16, share_group=world, job_group=world))),
            # the ranks' served teachers compared when the step is built (before anything is asked)
            "step_url_differs": lambda: with_teacher(step_with, url, other),
            "step_context_key_differs": lambda: with_teacher(step_with, context=("hint", "other")),
            "step_replicas_in_any_order": lambda: with_teacher(step_with, f"{url}|{other}", f"{other}|{url}"),
            # and before ServedTeacher.score(batch, group=...) asks
            "score_url_differs": lambda: with_teacher(scored, url, other),
            "score_top_k_differs": lambda: with_teacher(scored, top_k=(K, K - 1)),
            "score_head_differs": lambda: with_teacher(scored, head=(head(), head(seed=6))),
            "score_same_teacher": lambda: with_teacher(scored),
        }
        for name, case in cases.items():
            if names is None or name in names:
                start = time.monotonic()
                out[name] = raised(case)
                out.setdefault("seconds", {})[name] = time.monotonic() - start
    return out


@pytest.mark.multirank
def test_one_ranks_bad_call_or_lying_host_is_the_same_error_on_every_rank_at_once():
    with vllm_like() as server, vllm_like() as other:
        ranks = run_multirank(one_rank_wrong, 2, url_of(server), url_of(other), timeout=60)
    expected = {
        "given_rows_differ": ("ServedTeacherRefusal", "failed on rank 1 of the group: ValueError: TeacherStep.add: "
                                                      "teacher 0's rows of sample 2 (scored= of TeacherStep.add()) are "
                                                      "not what the served teacher answers"),
        "given_rows_meta": ("ServedTeacherRefusal", "failed on rank 1 of the group: ValueError: TeacherStep.add: "
                                                    "teacher 0's rows of sample 0 (scored= of TeacherStep.add()) are "
                                                    "not what the served teacher answers: tail_log_probs is on the "
                                                    "meta device (a shape without data)"),
        "carried_malformed": ("ValueError", "slime_opd: sample 1's train_metadata['megatron_rl_patches_teacher_rows']"),
        "collect_unsent": ("RuntimeError", "nothing sent"),
        "send_not_a_batch": ("TypeError", "takes a TeacherBatch, got str"),
        "sent_twice": ("RuntimeError", "was not collected"),
        "projected_differs": ("ValueError", "projected differs"),
        "batch_differs": ("ValueError", "sent different batches"),
        "added_differs": ("ValueError", "sent different batches"),
        "add_not_a_batch": ("TypeError", "TeacherStep.add(batch) takes a TeacherBatch, got str"),
        "bad_plan": ("ValueError", "the plan asks top_k=8"),
        "steps_after": ("", "no error"),
        "joined": ("", "no error"),
        "unjoined": ("RuntimeError", "in different calls"),
        "build_bad_top_k": ("ValueError", "top_k"),
        "build_entries_differ": ("ValueError", "the ranks name different teachers"),
        "build_unprobed": ("ValueError", "its tokenizer is checked against the student's"),
        "joined_but_shared": ("ValueError", "but rank 1 builds no step"),
        "share_none": ("ValueError", "sharing groups"),
        "share_apart": ("ValueError", "sharing groups"),
        "vocab_differs": ("ValueError", "vocab_size differs"),
        "step_url_differs": ("ValueError", "TeacherStep: teacher 0 differs between the ranks in its URL(s) (rank 0: "
                                           f"{url_of(server)}, rank 1: {url_of(other)})"),
        "step_context_key_differs": ("ValueError", "teacher 0 differs between the ranks in its context key (rank 0: "
                                                   "'hint', rank 1: 'other')"),
        "step_replicas_in_any_order": ("", "no error"),
        "score_url_differs": ("ValueError", "ServedTeacher.score(group=...): the teacher differs between the ranks in "
                                            f"its URL(s) (rank 0: {url_of(server)}, rank 1: {url_of(other)})"),
        "score_top_k_differs": ("ValueError", f"in its top_k (rank 0: {K}, rank 1: {K - 1})"),
        "score_head_differs": ("ValueError", "the teacher differs between the ranks in its head (rank 0: a head "
                                             "built by hand (fingerprint weight:"),
        "score_same_teacher": ("", "no error"),
    }
    for case, (kind, words) in expected.items():
        assert ranks[0][case] == ranks[1][case], case
        assert ranks[0][case][0] == kind and words in ranks[0][case][1], (case, ranks[0][case])
    # at once: no rank waited for another (gloo's timeout is minutes)
    assert max(max(r["seconds"].values()) for r in ranks) < 10, ranks[0]["seconds"]


@pytest.mark.multirank
def test_asked_once_per_group_shared_and_failures_raised_alike():
    with vllm_like() as server:
        ranks = run_multirank(rank_steps, 2, url_of(server))
        completions = [path for path, _ in server.seen if path == "/v1/completions"]
        models = [path for path, _ in server.seen if path == "/v1/models"]
    assert [r["asks"] for r in ranks] == [True, False]
    # 3 samples for the first step, none for the refused one (too long: refused before sending), 3 for the
    # in-process failure's step, and the one probe of K when the served model is first asked: by rank 0 only
    # (both ranks asking would be 14 and 2 model queries)
    # + the two built from entries (a model query and a probe of K each): rank 0 connects them
    # (+ 3: the streamed step's samples, added in parts)
    assert len(models) == 1 + 2 and len(completions) == 1 + 6 + 2 + 3
    assert ranks[0]["bad_vocab"] == ranks[1]["bad_vocab"] and "past the served model's vocabulary of 5" in \
        ranks[0]["bad_vocab"]
    assert ranks[0]["scores"] == ranks[1]["scores"]
    assert ranks[0]["added"] == ranks[1]["added"] == ranks[0]["scores"]  # added in parts: as one send
    assert [r["metrics"] for r in ranks] == [{"samples": 3, "rows": 6, "adds": 2, "collects": 1}] * 2
    assert [r["served_samples"] for r in ranks] == [3, 0]  # asked by rank 0 alone
    served, in_process = ranks[0]["scores"]
    assert served[1][:K] == [0.0, 1.0, 2.0, 3.0]
    assert in_process[2][:K] == pytest.approx([-math.log(2) * i for i in (1, 2, 3, 4)])
    for case, kind, words in (("refused", "ServedTeacherRefusal", "over"), ("broken", "ServedTeacherError",
                                                                          "in-process teacher broke on rank 1")):
        assert ranks[0][case] == ranks[1][case], case
        assert ranks[0][case][0] == kind and words in ranks[0][case][1]


def test_without_distributed_the_step_scores_in_place_and_passes_in_process_teachers_through_the_host():
    seen = []

    def teacher_pass(teacher, samples):
        seen.append(type(teacher).__name__)
        return teacher.score(samples)

    with vllm_like() as server, ServedTeacher(url_of(server), "vllm", top_k=K) as served:
        step = TeacherStep([served, RankTeacher(0)], local_host(12, teacher_pass))
        assert step.plan == StepPlan(K, 1.0, None)  # the mode: the setting's
        step.send(batch())
        served_scores, in_process = step.collect()
    assert seen == ["RankTeacher"] and len(served_scores) == 3 and len(in_process) == 3
    assert [len(t) for t in served_scores.tail_log_probs] == [3, 2, 1]


def test_bad_arguments_are_refused():
    host = local_host(12)
    with pytest.raises(TypeError, match="non-empty list of teachers"):
        TeacherStep([], host)
    with pytest.raises(TypeError, match="has no share_group"):
        TeacherStep([RankTeacher(0)], object())
    with pytest.raises(ValueError, match="the plan asks top_k=8"):
        TeacherStep([RankTeacher(0)], host, StepPlan(8))
    with pytest.raises(ValueError, match="vocab_size"):
        LoopHost(vocab_size=0)
    step = TeacherStep([RankTeacher(0)], host)
    with pytest.raises(RuntimeError, match=r"^TeacherStep\.collect: nothing sent: call send\(batch\) first$"):
        step.collect()
    with pytest.raises(TypeError, match="takes a TeacherBatch"):
        step.send([torch.tensor([1, 2])])
    step.send(batch())
    with pytest.raises(RuntimeError, match="not collected"):
        step.send(batch())


class WarmTeacher(RankTeacher):
    plan = StepPlan(K, 0.7)  # the plan it was built with (a teacher without one: its top_k at temperature 1)


def test_the_plan_is_each_teachers_temperature_and_a_different_one_is_refused():
    host = local_host(12)
    assert TeacherStep([WarmTeacher(0)], host).plan == StepPlan(K, 0.7)
    differ = r"the teachers' \(top_k, temperature, invariant\) differ \(\[\(4, 0\.7, None\), \(4, 1\.0, None\)\]\)"
    with pytest.raises(ValueError, match=differ):
        TeacherStep([WarmTeacher(0), RankTeacher(0)], host)
    with pytest.raises(ValueError, match=r"scores top_k=4 at temperature 0\.7, the plan asks top_k=4 at 1\.0"):
        TeacherStep([WarmTeacher(0)], host, StepPlan(K))


H = 8


def pooled_states(ids: list[int]) -> torch.Tensor:
    """The hidden states the pooling server answers: position p's from its id alone."""
    return torch.tensor(ids, dtype=torch.float32)[:, None] / 10 + torch.arange(H, dtype=torch.float32) / 100


def pooling(body):
    raw = pooled_states(body["input"]).numpy().tobytes()
    item = {"index": 0, "embed_dtype": "float32", "endianness": "little", "start": 0, "end": len(raw),
            "shape": [len(body["input"]), H]}
    return 200, (raw, {"metadata": json.dumps({"data": [item]})})


def head(seed: int = 5) -> TeacherHead:
    weight = torch.randn(12, H, generator=torch.Generator().manual_seed(seed))
    return TeacherHead(weight=weight, vocab_size=12, padded_vocab_size=12, first_id=0)


def rank_head_step(rank: int, world_size: int, url: str) -> list:
    import torch.distributed as dist

    host = LoopHost(vocab_size=12, share_group=dist.group.WORLD, job_group=dist.group.WORLD)
    with ServedTeacher(url, "vllm", top_k=K, head=head()) as served:
        step = TeacherStep([served], host)
        step.send(batch())
        (scores,) = step.collect()
    return [flat(scores), [s.tolist() for s in scores.hidden_states]]


@pytest.mark.multirank
def test_a_head_teachers_states_are_asked_once_and_projected_on_every_rank():
    with vllm_like(pooling=pooling) as server:
        ranks = run_multirank(rank_head_step, 2, url_of(server))
        asked = [path for path, _ in server.seen if path == "/pooling"]
    assert len(asked) == 1 + 3  # the probe and the 3 samples, from rank 0 only
    assert ranks[0] == ranks[1]
    samples = batch()
    states = [pooled_states(ids.tolist())[start - 1: -1]
              for ids, start in zip(samples.sequences, samples.response_starts)]
    expected = head_scores(head(), samples, states, StepPlan(K))
    assert ranks[0][0] == flat(expected)
