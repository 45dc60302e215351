"""slime_opd's served teacher (`served_opd`) against the session's real vLLM server (conftest):
a step through `opd.score_teachers` with the served teacher first (its own top-k are the step's
buckets, MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher) and an in-process teacher of the same weights
scoring them; the scores against transformers' forward, the exact-tail loss of the student's step
against float64, the tokenizer probe, and a server that dies mid-step. (Runs before
test_served_vllm.py, whose last test stops the server.)"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from megatron_rl_patches import topk_kl
from megatron_rl_patches.integrations.megatron.opd import served_opd
from megatron_rl_patches.integrations.megatron.opd.opd_settings import OpdSettings, opd_settings
from megatron_rl_patches.integrations.megatron.opd.opd_teachers import STEP_REQUEST, SeparateTeacher
from megatron_rl_patches.integrations.megatron.opd.served_teacher import served_own
from megatron_rl_patches.integrations.megatron.opd.stage_host import batch_of, stage_host
from megatron_rl_patches.integrations.megatron.opd.teacher_builders import BUILDERS
from megatron_rl_patches.integrations.slime import opd
from megatron_rl_patches.ops.topk import log1mexp
from megatron_rl_patches.teachers import ServedTeacherError
from megatron_rl_patches.teachers.kinds import parse_entry
from tests.teachers.lane.forwarder import Forwarder
from tests.teachers.lane.served_kit import VOCAB

K = 8
LENGTHS, PROMPTS = (14, 40, 9, 60), (3, 17, 1, 30)


@dataclass
class DenseRows:
    """A model's float64 log-softmax over the whole vocabulary on the rows that score ids[start:]."""

    forward: object
    vocab_size: int = VOCAB

    def rows(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        return torch.log_softmax(self.forward(ids).double(), dim=-1)[start - 1:-1]


def hf_rows(model) -> DenseRows:
    double = copy.deepcopy(model).double().eval()

    def forward(ids):
        with torch.no_grad():
            return double(ids[None]).logits[0]

    return DenseRows(forward)


def student_rows(seed: int) -> DenseRows:
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return DenseRows(lambda ids: weight[torch.roll(ids, 1)] + weight[ids])


def topk_pass(args, model, rollout_data, request, invariant=None):
    """opd's `topk_pass` contract over dense float64 rows: the top-`request.k` ids, or the ids of
    `request.ids_key` scored, with their exact tail."""
    (dense,) = model
    out: dict[str, list[torch.Tensor]] = {"log_probs": [], "topk_ids": [], "topk_log_probs": [], "tail": []}
    for i, (tokens, response) in enumerate(zip(rollout_data["tokens"], rollout_data["response_lengths"])):
        rows = dense.rows(tokens, len(tokens) - int(response))
        out["log_probs"].append(rows.gather(1, tokens[-int(response):, None])[:, 0])
        ids = rows.topk(request.k).indices if request.k is not None else rollout_data[request.ids_key][i]
        if request.k is not None:
            out["topk_ids"].append(ids)
        logp = rows.gather(1, ids)
        out["topk_log_probs"].append(logp)
        out["tail"].append(log1mexp(torch.logsumexp(logp, dim=-1)))
    return {key: values for key, values in out.items() if values}


class Actor:
    def __init__(self, student: DenseRows, directory):
        self.args = SimpleNamespace(use_opd=False, hf_checkpoint=str(directory), rollout_temperature=1.0)
        self.model, self._active_model_tag = [student], "actor"

    def _switch_model(self, tag: str) -> None:
        self._active_model_tag = tag


def rollout() -> dict:
    gen = torch.Generator().manual_seed(11)
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]
    responses = [n - p for n, p in zip(LENGTHS, PROMPTS)]
    return {"tokens": tokens, "response_lengths": responses, "total_lengths": list(LENGTHS)}


def settings(url: str) -> OpdSettings:
    """The served entry first (its ids the buckets), an in-process teacher second."""
    chosen = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": f"{url};engine=vllm,/in-process",
                           "MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teacher", "MEGATRON_RL_PATCHES_OPD_K": str(K)})
    assert chosen is not None and chosen.teachers[0].kind == "served"
    return chosen


def build_served(args, url: str) -> served_opd.ServedOpdTeacher:
    """slime's served teacher of the student's tokenizer at `url` on this rank's host (the entry
    named "entry" in its errors)."""
    host = stage_host(VOCAB)
    return served_opd.ServedOpdTeacher(served_own(args, settings(url), parse_entry(f"{url};engine=vllm"), host,
                                                  "entry"), host)


def built(actor, url: str) -> served_opd.ServedOpdTeacher:
    """slime's builder of the served row (`teacher_builders.BUILDERS`), from the actor."""
    chosen = settings(url)
    teacher = BUILDERS["served"].build(actor, chosen, 0, chosen.teachers[0], VOCAB, "served")
    assert isinstance(teacher, served_opd.ServedOpdTeacher)
    return teacher


@pytest.fixture(scope="module")
def step(served):
    """One step scored: the served teacher first, the same weights in process second."""
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    actor = Actor(student_rows(5), served.directory)
    chosen = settings(served.url)
    data = rollout()
    with megatron_on_cpu(), pytest.MonkeyPatch.context() as patch:
        teacher = built(actor, served.url)
        setattr(actor, opd.ATTRIBUTE, [teacher, SeparateTeacher([hf_rows(served.model)])])
        patch.setattr(opd, "topk_pass", topk_pass)
        opd.score_teachers(actor, data, chosen)
    teacher.teacher.close()
    return SimpleNamespace(actor=actor, data=data, reference=hf_rows(served.model))


def test_the_served_teachers_own_topk_are_the_steps_buckets_within_transformers_forward(step):
    data, reference = step.data, step.reference
    worst = 0.0
    for i, (tokens, prompt) in enumerate(zip(data["tokens"], PROMPTS)):
        ref = reference.rows(tokens, prompt)
        worst = max(worst, float((data[opd.TEACHER_LOGPROBS][i][0].double() - ref.gather(1, data[opd.IDS][i])).abs()
                                 .max()))
        ids = data[opd.IDS][i]
        assert ids.shape == (len(tokens) - prompt, K) and opd.IDS_MASK not in data
        assert (ids == ref.topk(K).indices).float().mean() > 0.9  # ties aside
        outside = ref.scatter(1, ids, float("-inf")).max(dim=1).values
        served, in_process = data[opd.TEACHER_LOGPROBS][i].double()
        assert bool((served[:, -1] >= outside - 1e-4).all())  # nothing outside beats the served top-k
        torch.testing.assert_close(served, ref.gather(1, ids), rtol=0, atol=1e-4)
        torch.testing.assert_close(in_process, ref.gather(1, ids), rtol=0, atol=1e-12)  # scored the served ids
        tails = data[opd.TEACHER_TAILS][i].double()
        complement = 1 - ref.gather(1, ids).exp().sum(1)
        torch.testing.assert_close(tails[0].exp(), complement, rtol=0, atol=1e-4)
    print(f"served top-{K} log-probs vs transformers' float64 forward: max |error| {worst:.2e}")


def test_the_students_step_through_the_served_buckets_gives_the_exact_tail_loss_of_float64(step):
    """The student's step scores the served ids (the training step's request); topk_kl against the
    two teachers' stored scores equals the float64 (k+1)-bucket reverse KL of the dense student
    against transformers' float64 teacher within 1e-5; without the tail (renormalized) it misses."""
    data, reference = step.data, step.reference
    student = topk_pass(step.actor.args, step.actor.model, data, STEP_REQUEST)
    worst = 0.0
    for i, (tokens, prompt) in enumerate(zip(data["tokens"], PROMPTS)):
        ids = data[opd.IDS][i]
        args = (student["topk_log_probs"][i], student["tail"][i], data[opd.TEACHER_LOGPROBS][i].double(),
                data[opd.TEACHER_TAILS][i].double())
        got = topk_kl(*args, divergence="reverse_kl")
        p = bucket_probs(step.actor.model[0].rows(tokens, prompt), ids)
        q = bucket_probs(reference.rows(tokens, prompt), ids)
        expected = (p * (p.log() - q.log())).sum(-1)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        worst = max(worst, float((got - expected).abs().max()))
        assert (topk_kl(*args, divergence="reverse_kl", renormalize=True) - expected).abs().max() > 1e-3
    print(f"topk_kl through the served buckets vs float64 (k+1)-bucket reverse KL: max |error| {worst:.2e}")


def bucket_probs(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    p = rows.gather(1, ids).exp()
    return torch.cat([p, 1 - p.sum(1, keepdim=True)], dim=1)


def test_a_served_model_of_another_tokenizer_is_refused_by_the_probe(served, tmp_path, megatron_cpu):
    """A student tokenizer spelling other ids (the served words in reverse order) fails the probe."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    other = Tokenizer(models.WordLevel({f"t{i}": VOCAB - 1 - i for i in range(VOCAB)}, unk_token="t0"))
    other.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    other.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"entry 'http://.*': the served model .* does not share the student's "
                                         r"tokenizer .*/tokenize"):
        built(Actor(student_rows(5), tmp_path), served.url)
    built(Actor(student_rows(5), served.directory), served.url).teacher.close()  # control: the student's own


def test_an_id_past_the_students_vocabulary_is_refused_naming_the_sample(served, megatron_cpu):
    actor = Actor(student_rows(5), served.directory)
    actor.model[0].vocab_size = 100  # a student of a smaller vocabulary than the served model's 1001
    teacher = built(actor, served.url)
    setattr(actor, opd.ATTRIBUTE, [teacher])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(opd, "topk_pass", topk_pass)
        with pytest.raises(ValueError, match=r"\(sample 0\): the served teacher's top-k holds id \d+, past the "
                                             r"student's vocabulary of 100"):
            opd.score_teachers(actor, rollout(), settings(served.url))
    teacher.teacher.close()


def test_a_server_that_dies_mid_step_fails_the_step_naming_it(served, megatron_cpu):
    """The requests sent before the student's pass; the server gone during it: the teacher's turn
    raises naming the URL and a sample, in bounded time."""
    link = Forwarder(int(served.url.rsplit(":", 1)[1]))
    actor = Actor(student_rows(5), served.directory)
    teacher = built(actor, link.url)
    setattr(actor, opd.ATTRIBUTE, [teacher])
    link.hold_all()

    def dying_pass(args, model, rollout_data, request, invariant=None):
        assert link.accepted.acquire(timeout=10)  # a request is in flight during the student's pass
        link.close()
        return topk_pass(args, model, rollout_data, request)

    start = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(opd, "topk_pass", dying_pass)
        with pytest.raises(ServedTeacherError, match=rf"{link.url}/v1/completions \(sample \d\): no answer after"):
            opd.score_teachers(actor, rollout(), settings(link.url))
    assert time.monotonic() - start < 30
    teacher.teacher.close()


# ------------------------------------------------------------------ one 2-rank world, every layout

def _rank_step(url: str, data: dict, last: bool) -> dict:
    """A served teacher's step on this rank (begin, then score): what it asked and the rows it kept."""
    from megatron_rl_patches.integrations.megatron.opd.opd_teachers import ScoringStep

    args = SimpleNamespace(hf_checkpoint=data.pop("hf"), rollout_temperature=1.0)
    teacher = build_served(args, url)
    asked: list[int] = []
    if teacher.teacher is not None:  # the last stage's ranks hold it
        submit = teacher.teacher.submit
        teacher.teacher.submit = lambda batch: asked.append(len(batch)) or submit(batch)
    teacher.begin(None, data)
    scores = teacher.score(ScoringStep(Actor(student_rows(5), args.hf_checkpoint), data, settings(url), last, {},
                                       topk_pass))
    if teacher.teacher is not None:
        teacher.teacher.close()
    kept = None if scores is None else {"ids": data[opd.IDS], "log_probs": scores.log_probs, "tails": scores.tails}
    return {"asked": asked, "kept": kept}


def served_world(rank: int, world: int, url: str, directory: str, dead: str) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rl_patches.integrations.megatron.opd.zigzag import whole_from_zigzag
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    results = {}
    for name, sizes in (("tp2", {"tensor_parallel": 2}), ("cp2", {"context_parallel": 2}),
                        ("pp2", {"pipeline_parallel": 2}), ("dp2", {})):
        with megatron_on_cpu(**sizes):
            data = rollout()
            if name == "dp2":  # each data-parallel rank its own samples
                data = {key: values[rank::2] for key, values in data.items()}
            last = ps.is_pipeline_last_stage(ignore_virtual=True)
            out = _rank_step(url, {**data, "hf": directory}, last)
            if name == "cp2":  # this rank's zigzag rows; the whole responses from both ranks'
                out["cut"] = [len(v) for v in out["kept"]["ids"]]
                out["kept"] = {key: whole_from_zigzag(values, data["total_lengths"], data["response_lengths"])
                               for key, values in out["kept"].items()}
            results[name] = out
    with megatron_on_cpu():  # rank 1's server gone at load: the same error on both ranks
        try:
            build_served(SimpleNamespace(hf_checkpoint=directory), dead if rank else url)
            results["dead"] = "no error"
        except ValueError as error:
            results["dead"] = str(error)
    results["unscored"] = _unscored_step(rank, url, directory)
    return results


def _unscored_step(rank: int, url: str, directory: str) -> dict:
    """Rank 0's step scores no teacher (its student pass gave no ids: opd's early return), rank 1's
    scores the served teacher, whose turn agrees failures over the job: both finish (before
    `unscored`, rank 1 waited in the agreement rank 0 never joined)."""
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    def no_ids_on_rank_0(args, model, rollout_data, request, invariant=None):
        out = topk_pass(args, model, rollout_data, request)
        return {key: value for key, value in out.items() if key != "topk_ids"} if rank == 0 else out

    with megatron_on_cpu(), pytest.MonkeyPatch.context() as patch:
        actor = Actor(student_rows(5), directory)
        chosen = settings(url)
        teacher = BUILDERS["served"].build(actor, chosen, 0, chosen.teachers[0], VOCAB, "served")
        setattr(actor, opd.ATTRIBUTE, [teacher])
        data = {key: values[rank::2] for key, values in rollout().items()}
        patch.setattr(opd, "topk_pass", no_ids_on_rank_0)
        start = time.monotonic()
        opd.score_teachers(actor, data, chosen)
        seconds = time.monotonic() - start
        teacher.teacher.close()
    return {"seconds": seconds, "scored": opd.IDS in data, "pending": teacher.step.batch is not None}


def test_each_sample_asked_once_per_data_parallel_rank_and_every_layout_keeps_its_rows(served):
    """TP=2: the group's first rank asks, both keep the same rows; CP=2: one asks, each rank keeps
    its zigzag rows (both together the whole responses); PP=2: the last stage asks and keeps, the
    first scores nothing; DP=2: each rank asks its own samples. Every layout's rows equal one
    rank's whole scores of the same samples. A server gone on one rank at load: one error on both.
    One rank's step scoring no teacher while the other's scores the served one: both finish."""
    from kit.ports import refused_port

    from megatron_rl_patches.testing.multirank import run_multirank

    with refused_port() as port:  # held while the ranks run: nothing can take it and answer
        dead = f"http://127.0.0.1:{port}"
        ranks = run_multirank(served_world, 2, served.url, str(served.directory), dead, timeout=400)
    samples = len(LENGTHS)
    with whole_teacher(served.url) as teacher:
        data = rollout()
        whole = teacher.score(batch_of(data))
    assert [r["tp2"]["asked"] for r in ranks] == [[samples], []]
    assert [r["cp2"]["asked"] for r in ranks] == [[samples], []]
    assert [r["pp2"]["asked"] for r in ranks] == [[], [samples]] and ranks[0]["pp2"]["kept"] is None
    assert [r["dp2"]["asked"] for r in ranks] == [[samples // 2], [samples // 2]]
    responses = [n - p for n, p in zip(LENGTHS, PROMPTS)]
    assert [sum(c) for c in zip(ranks[0]["cp2"]["cut"], ranks[1]["cp2"]["cut"])] == responses
    assert ranks[0]["cp2"]["cut"] != responses  # negative control: each rank holds part of each response
    for name, rank in (("tp2", 0), ("tp2", 1), ("cp2", 0), ("cp2", 1), ("pp2", 1)):
        kept = ranks[rank][name]["kept"]
        for i in range(samples):
            assert torch.equal(kept["ids"][i], whole.topk_ids[i]), (name, rank, i)
            torch.testing.assert_close(kept["log_probs"][i], whole.topk_log_probs[i].float(), rtol=0, atol=1e-6)
            torch.testing.assert_close(kept["tails"][i], whole.tail_log_probs[i].float(), rtol=0, atol=1e-6)
    for rank in (0, 1):
        kept = ranks[rank]["dp2"]["kept"]
        for j, i in enumerate(range(rank, samples, 2)):
            assert torch.equal(kept["ids"][j], whole.topk_ids[i])
    assert ranks[0]["dead"] == ranks[1]["dead"] and "entry: served teacher failed on rank 1" in ranks[0]["dead"]
    assert [r["unscored"]["scored"] for r in ranks] == [False, True]  # rank 0's early return, rank 1 scored
    assert not any(r["unscored"]["pending"] for r in ranks)  # rank 0's requests collected too
    assert max(r["unscored"]["seconds"] for r in ranks) < 60
    assert f"{dead}/v1/models" in ranks[0]["dead"]


def whole_teacher(url: str):
    from megatron_rl_patches.teachers import ServedTeacher

    return ServedTeacher(url, "vllm", top_k=K)
