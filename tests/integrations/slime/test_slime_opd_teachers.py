"""slime_opd's one teacher interface (`opd_teachers`): every kind of teacher scores a step into the
same shape contract (`TeacherScores`: [R, k] bucket log-probs and [R] tails on the student's response
rows), a snapshot and a separate model of the same weights score alike, and a teacher with another
tokenizer wrapping either equals the composition of the cross-tokenizer steps written out (the route
before the interface) bit for bit. The passes run real vocabulary ops over small language-model
heads on real tokenizers (the slime lane runs them through slime's `forward_only`)."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("tokenizers")

from megatron_rl_patches.cross_tokenizer import teacher_passes as ct  # noqa: E402
from megatron_rl_patches.integrations.megatron.opd import cross_passes
from megatron_rl_patches.integrations.megatron.opd.cross_rollout import teacher_rollout  # noqa: E402
from megatron_rl_patches.integrations.megatron.opd.opd_settings import Teacher, opd_settings  # noqa: E402
from megatron_rl_patches.integrations.megatron.opd.opd_teachers import (  # noqa: E402
    STEP_REQUEST,  # noqa: E402
    PassTeacher,
    ScoringStep,
    SeparateTeacher,
    SnapshotTeacher,
    TeacherScores,
    model_teacher,
)
from megatron_rl_patches.integrations.slime import opd  # noqa: E402
from megatron_rl_patches.integrations.slime.actor import SlimeActor  # noqa: E402
from megatron_rl_patches.ops.lm_head import (  # noqa: E402
    lm_head_log_probs_and_entropy,
    lm_head_topk_ids,
    lm_head_topk_logprobs,
)
from tests.cross_tokenizer import conftest as tokenizers  # noqa: E402
from tests.cross_tokenizer.conftest import TEXTS  # noqa: E402

qwen3, deepseek = tokenizers.qwen3, tokenizers.deepseek  # the real-tokenizer fixtures

H, K = 8, 4
PROMPTS = ("Q: ", "<|im_start|>user\nhi<|im_end|>\n")
RESPONSES = (TEXTS["mixed"], TEXTS["english"] + TEXTS["emoji"])


@dataclass(frozen=True)
class TinyHead:
    """A language-model head over its own vocabulary: row i's hidden state from tokens i and i-1."""

    embedding: torch.Tensor
    weight: torch.Tensor

    @classmethod
    def random(cls, vocab: int, seed: int) -> TinyHead:
        g = torch.Generator().manual_seed(seed)
        return cls(torch.randn(vocab, H, generator=g, dtype=torch.float64),
                   torch.randn(vocab, H, generator=g, dtype=torch.float64))

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.embedding[tokens] + 0.5 * self.embedding[torch.roll(tokens, 1)]) * 3


def topk_pass(args, model, rollout_data, request, invariant=None):
    """opd's `topk_pass` contract over `model[0]` (a TinyHead): per sample on the response rows, the
    tokens' log-probs, the top-k ids asked (`request.k`) or the ids of `request.ids_key` scored (with
    `request.mask_key`), and their tail. Without those ids (a stage before the last), nothing."""
    (head,) = model
    if request.ids_key is not None and request.ids_key not in rollout_data:
        return {}
    out: dict[str, list[torch.Tensor]] = {"log_probs": [], "topk_ids": [], "topk_log_probs": [], "tail": []}
    for i, (tokens, response) in enumerate(zip(rollout_data["tokens"], rollout_data["response_lengths"])):
        hidden = head.hidden(tokens)[-int(response):]
        out["log_probs"].append(lm_head_log_probs_and_entropy(hidden, head.weight, tokens[-int(response):])[0])
        if request.k is not None:
            ids, mask = lm_head_topk_ids(hidden, head.weight, request.k), None
            out["topk_ids"].append(ids)
        else:
            ids = rollout_data[request.ids_key][i]
            mask = None if request.mask_key is None else rollout_data[request.mask_key][i]
        logp, tail = lm_head_topk_logprobs(hidden, head.weight, ids, ids_mask=mask)
        out["topk_log_probs"].append(logp)
        out["tail"].append(tail)
    return {key: values for key, values in out.items() if values}


class Actor:
    """slime's actor as the teachers see it: args, its model, the snapshot switch (which swaps the
    weights inside the actor's one model, as slime's TensorBackuper does)."""

    def __init__(self, student: TinyHead, snapshots: dict[str, TinyHead]):
        self.args = SimpleNamespace(use_opd=False)
        self.heads = {"actor": student, **snapshots}
        self.model, self._active_model_tag = [student], "actor"

    def _switch_model(self, tag: str) -> None:
        self.model[0], self._active_model_tag = self.heads[tag], tag


def rollout(student_tokenizer) -> dict:
    """slime's rollout fields of two samples (prompt then response ids; one micro-batch each)."""
    from megatron_rl_patches.cross_tokenizer import load_tokenizer

    tok = load_tokenizer(student_tokenizer)
    tokens, responses = [], []
    for prompt, response in zip(PROMPTS, RESPONSES):
        p, r = (tok.encode(text, add_special_tokens=False).ids for text in (prompt, response))
        tokens.append(torch.tensor(p + r))
        responses.append(len(r))
    return {"tokens": tokens, "response_lengths": responses, "total_lengths": [len(t) for t in tokens],
            "loss_masks": [torch.ones(r, dtype=torch.int) for r in responses], "micro_batch_indices": [[0], [1]],
            "num_microbatches": [2]}


def step_of(actor: Actor, data: dict, settings) -> ScoringStep:
    """The step after the student's pass (its top-k ids in the rollout data), on the last stage."""
    student = topk_pass(actor.args, actor.model, data, opd.TopkRequest(k=settings.k))
    data[opd.IDS] = student["topk_ids"]
    return ScoringStep(SlimeActor(actor), data, settings, True, student, topk_pass)  # as slime's opd hands it


def cross_teacher(actor_args, teacher_dir, model) -> cross_passes.CrossTokenizerTeacher:
    return cross_passes.load_cross(actor_args, Teacher(str(teacher_dir), own_tokenizer=True), model)


@pytest.fixture
def world(megatron_cpu, slime_standin, qwen3, deepseek, tmp_path):
    """The student (Qwen's tokenizer) and a teacher (DeepSeek's), each a tiny head of its vocabulary."""
    from megatron_rl_patches.cross_tokenizer import load_tokenizer

    for name, tok in (("student", qwen3), ("teacher", deepseek)):
        (tmp_path / name).mkdir()
        load_tokenizer(tok).save(str(tmp_path / name / "tokenizer.json"))
    student = TinyHead.random(load_tokenizer(qwen3).get_vocab_size(), 0)
    same = TinyHead.random(student.weight.shape[0], 1)
    other = TinyHead.random(load_tokenizer(deepseek).get_vocab_size(), 2)
    actor = Actor(student, {"opd_teacher_0": same, "opd_teacher_1": other})
    actor.args.hf_checkpoint = str(tmp_path / "student")
    settings = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": f"/s,{tmp_path / 'teacher'};tokenizer=own",
                             "MEGATRON_RL_PATCHES_OPD_K": str(K)})
    return SimpleNamespace(actor=actor, same=same, other=other, data=rollout(qwen3), settings=settings,
                           teacher_dir=tmp_path / "teacher")


def shapes(scores: TeacherScores) -> list[tuple]:
    return [(tuple(lp.shape), tuple(tail.shape)) for lp, tail in zip(scores.log_probs, scores.tails)]


def test_every_teacher_returns_the_contracts_shapes(world):
    rows = world.data["response_lengths"]
    want = [((r, K), (r,)) for r in rows]
    teachers = {"snapshot": SnapshotTeacher("opd_teacher_0"), "separate": SeparateTeacher([world.same]),
                "cross over a snapshot": cross_teacher(world.actor.args, world.teacher_dir, "opd_teacher_1"),
                "cross over a separate model": cross_teacher(world.actor.args, world.teacher_dir, [world.other])}
    step = step_of(world.actor, world.data, world.settings)
    scored = {name: teacher.score(step) for name, teacher in teachers.items()}
    for name, scores in scored.items():
        assert scores is not None and shapes(scores) == want, name
    for name in ("snapshot", "separate"):  # buckets over the step's ids
        assert scored[name].ids is None and scored[name].alive is None and scored[name].log_ratio is None
    for name in ("cross over a snapshot", "cross over a separate model"):  # grouped buckets
        s = scored[name]
        depth = s.ids[0].shape[-1] // K
        assert [tuple(t.shape) for t in s.ids] == [(r, K * depth) for r in rows] and depth >= 1
        assert [tuple(t.shape) for t in s.ids_mask] == [(r, K * depth) for r in rows]
        assert [tuple(t.shape) for t in s.alive] == [(r, K) for r in rows]
        assert [tuple(t.shape) for t in s.log_ratio] == [(r,) for r in rows]
    # a snapshot and a separate model of the same weights score alike; so do the two wrapped ones
    for a, b in (("snapshot", "separate"), ("cross over a snapshot", "cross over a separate model")):
        for field in ("log_probs", "tails"):
            assert all(torch.equal(x, y) for x, y in zip(getattr(scored[a], field), getattr(scored[b], field)))
    # negative control: the other teacher's weights change the scores
    other = SeparateTeacher([TinyHead.random(world.same.weight.shape[0], 7)]).score(step)
    assert not torch.equal(other.log_probs[0], scored["separate"].log_probs[0])


def old_route(actor, data, teacher, settings, student_log_probs):
    """The cross teacher's scores as the route before the interface composed them (cross_passes.score
    of 544f86b, with one rank's cut): the teacher's samples and rollout, its top-k pass, the chunk-start
    buckets, the bucket pass, the values brought back to the student's rows."""
    model = teacher.model.model_chunks(SlimeActor(actor))
    samples = [ct.teacher_sample(t, int(r), m, teacher.pair.student_tokenizer, teacher.pair.tokenizer)
               for t, r, m in zip(data["tokens"], data["response_lengths"], data["loss_masks"])]
    budget = ct.student_budget(data["total_lengths"], data["micro_batch_indices"])
    own = teacher_rollout(samples, ct.pass_batches([s.tokens.numel() for s in samples], budget,
                                                  len(data["micro_batch_indices"])))
    first = topk_pass(actor.args, model, own, opd.TopkRequest(k=settings.k))
    buckets = [ct.chunk_start_buckets(ids, s.alignment, teacher.pair.shared) for ids, s in zip(first["topk_ids"],
                                                                                                 samples)]
    own["ids"], own["mask"] = [b.teacher_ids for b in buckets], [b.teacher_mask for b in buckets]
    second = topk_pass(actor.args, model, own, opd.TopkRequest(ids_key="ids", mask_key="mask", keys=("ids", "mask")))
    brought = [ct.teacher_buckets_on_student_rows(lp, tail, b, s.alignment)
               for lp, tail, b, s in zip(second["topk_log_probs"], second["tail"], buckets, samples)]
    return {"ratio": [ct.log_ratio(student.float(), teacher.float(), s.alignment)
                      for student, teacher, s in zip(student_log_probs, first["log_probs"], samples)],
            "logprobs": [values.float() for values, _ in brought], "tails": [tails.float() for _, tails in brought],
            "alive": [b.alive for b in buckets], "ids": [b.student_ids for b in buckets],
            "mask": [b.student_mask for b in buckets]}


@pytest.mark.parametrize("inner", ["separate (a Hugging Face teacher's chunks)", "snapshot"])
def test_a_cross_teacher_wrapping_either_equals_the_route_before_bit_for_bit(world, inner):
    model = [world.other] if inner.startswith("separate") else "opd_teacher_1"
    teacher = cross_teacher(world.actor.args, world.teacher_dir, model)
    assert isinstance(teacher.model, SeparateTeacher if inner.startswith("separate") else SnapshotTeacher)
    step = step_of(world.actor, world.data, world.settings)
    scores = teacher.score(step)
    want = old_route(world.actor, world.data, teacher, world.settings, step.student["log_probs"])
    got = {"ratio": scores.log_ratio, "logprobs": scores.log_probs, "tails": scores.tails, "alive": scores.alive,
           "ids": scores.ids, "mask": scores.ids_mask}
    for field, values in want.items():
        assert len(got[field]) == len(values) == 2
        assert all(torch.equal(a, b) for a, b in zip(got[field], values)), field
    assert any(bool(a.any()) for a in scores.alive) and all(bool(r.abs().sum() > 0) for r in scores.log_ratio)
    off_last = ScoringStep(SlimeActor(world.actor), world.data, world.settings, False, step.student, topk_pass)
    assert not teacher.score(off_last)


def test_score_teachers_is_one_loop_over_the_interface(world, monkeypatch):
    """A snapshot and a cross teacher through `score_teachers`: the fields each kind stores are its
    own scores (the step's ids' mixture, then the step ids and grouped buckets), the actor restored;
    the forms the attribute held before the interface (a tag, a list of chunks) still score."""
    actor, data = world.actor, world.data
    cross = cross_teacher(actor.args, world.teacher_dir, [world.other])
    setattr(actor, opd.ATTRIBUTE, ["opd_teacher_0", cross])  # a plain tag, as the pipeline test sets it
    monkeypatch.setattr(opd, "topk_pass", topk_pass)
    opd.score_teachers(actor, data, world.settings)
    assert actor._active_model_tag == "actor"
    step = step_of(Actor(actor.heads["actor"], {}), rollout(actor.args.hf_checkpoint), world.settings)
    same = model_teacher([world.same]).score(step)
    assert all(torch.equal(a[0], b) for a, b in zip(data[opd.TEACHER_LOGPROBS], same.log_probs))
    assert [tuple(t.shape) for t in data[opd.TEACHER_LOGPROBS]] == [(1, r, K) for r in data["response_lengths"]]
    scored = cross.score(step)
    assert all(torch.equal(a[:, 0], b) for a, b in zip(data[opd.CROSS_RATIO], scored.log_ratio))
    step_ids = [torch.cat([i, d], dim=1) for i, d in zip(data[opd.IDS], scored.ids)]
    assert all(torch.equal(a, b) for a, b in zip(data["opd_step_ids"], step_ids))


class Delegating(PassTeacher):
    """A teacher that is no model: its passes are another teacher's (as a served teacher's would be
    its engine's)."""

    def __init__(self, inner: PassTeacher):
        self.inner = inner

    def passes(self, step):
        return self.inner.passes(step)

    def score(self, step):
        raise AssertionError("a wrapped teacher's passes are run, never its own score")


def test_a_cross_teacher_wraps_any_pass_teacher_not_only_a_model(world):
    """CrossTokenizerTeacher asks its inner teacher for its pass function only: a PassTeacher that
    has no model chunks gives the same scores, bit for bit, as the model it delegates to."""
    step = step_of(world.actor, world.data, world.settings)
    direct = cross_teacher(world.actor.args, world.teacher_dir, [world.other]).score(step)
    wrapped = cross_teacher(world.actor.args, world.teacher_dir, Delegating(SeparateTeacher([world.other])))
    assert isinstance(wrapped.model, Delegating)
    scores = wrapped.score(step)
    for field in ("log_probs", "tails", "ids", "ids_mask", "alive", "log_ratio"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(scores, field), getattr(direct, field))), field


def dense(head: TinyHead, tokens: torch.Tensor, rows: int) -> torch.Tensor:
    """The head's float64 log-softmax over its whole vocabulary on the last `rows` rows."""
    return torch.log_softmax(head.hidden(tokens)[-rows:] @ head.weight.T, dim=-1)


def buckets(log_probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The (k+1) bucket probabilities [R, k + 1] of a dense distribution at `ids` (the tail last)."""
    p = log_probs.gather(-1, ids).exp()
    return torch.cat([p, (1 - p.sum(-1, keepdim=True))], dim=-1)


def test_ids_from_teacher_the_first_teachers_own_topk_are_every_models_buckets(world, monkeypatch):
    """MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher through `score_teachers`: the first teacher's own
    top-k (a snapshot: selected as a union's first teacher selects them) become the step's ids, its
    scores and a second teacher's are those of float64's whole distributions at them, and the
    student's step scoring them (the training step's request) gives the (k+1)-bucket reverse KL
    of float64's against the teachers' mixture."""
    actor, data = world.actor, world.data
    second = TinyHead.random(world.same.weight.shape[0], 3)
    setattr(actor, opd.ATTRIBUTE, [SnapshotTeacher("opd_teacher_0"), SeparateTeacher([second])])
    settings = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/s,/t", "MEGATRON_RL_PATCHES_OPD_K": str(K),
                             "MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teacher"})
    monkeypatch.setattr(opd, "topk_pass", topk_pass)
    opd.score_teachers(actor, data, settings)
    assert actor._active_model_tag == "actor" and opd.IDS_MASK not in data
    student = topk_pass(actor.args, actor.model, data, STEP_REQUEST)  # the training step's scoring
    moved = 0
    for i, (tokens, rows) in enumerate(zip(data["tokens"], data["response_lengths"])):
        first, other, own = (dense(head, tokens, rows) for head in (world.same, second, actor.heads["actor"]))
        assert torch.equal(data[opd.IDS][i], first.topk(K, dim=-1).indices)  # no ties in random float64
        moved += int(not torch.equal(data[opd.IDS][i], own.topk(K, dim=-1).indices))  # negative control
        for t, reference in enumerate((first, other)):
            want = reference.gather(-1, data[opd.IDS][i])
            torch.testing.assert_close(data[opd.TEACHER_LOGPROBS][i][t], want, rtol=0, atol=1e-12)
            torch.testing.assert_close(data[opd.TEACHER_TAILS][i][t], torch.log1p(-want.exp().sum(-1)), rtol=0,
                                       atol=1e-10)
        got = opd.topk_kl(student["topk_log_probs"][i], student["tail"][i], data[opd.TEACHER_LOGPROBS][i],
                          data[opd.TEACHER_TAILS][i], divergence="reverse_kl")
        p = buckets(own, data[opd.IDS][i])
        q = (buckets(first, data[opd.IDS][i]) + buckets(other, data[opd.IDS][i])) / 2
        torch.testing.assert_close(got, (p * (p.log() - q.log())).sum(-1), rtol=0, atol=1e-10)
    assert moved == len(data["tokens"])  # the student's own top-k would be other buckets
