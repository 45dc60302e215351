"""Teachers with a privileged context in the public teacher step: the entry option `;context=KEY`
read by every kind and carried on the teacher; `TeacherStep.send(batch, contexts=...)` (keyed or
per-sample) gives each teacher with a key `with_context(batch, its contexts)` and the others the
student's batch; their rows line up with the student's; a served teacher is sent the privileged
sequence (the stand-in server records it); a missing key on one sample of one rank is the same
error on every rank of a 2-rank gloo world, sample and key named, and so are a served teacher's
different contexts on the ranks of one sharing group (only the asking rank asks)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers import (
    BatchScores,
    LoopHost,
    ServedTeacher,
    ServedTeacherRefusal,
    TeacherBatch,
    TeacherStep,
    build_teachers,
    local_host,
)
from megatron_rl_patches.teachers.kinds import parse_entry
from megatron_rl_patches.testing.multirank import run_multirank
from tests.teachers.local_servers import MAX_MODEL_LEN, completions, url_of, vllm_like

K = 2


@pytest.mark.parametrize(("entry", "path", "kind"), [
    ("http://h:8000;engine=vllm;context=solution", "http://h:8000", "served"),
    ("http://h:8000;context=solution;engine=vllm;head=/ckpt/t", "http://h:8000", "served"),
    ("/ckpt/teacher;context=solution", "/ckpt/teacher", "checkpoint"),
    ("/ckpt/teacher;tokenizer=own; context = solution", "/ckpt/teacher", "checkpoint"),
    ("/ckpt/teacher@models:provider;context=solution", "/ckpt/teacher", "provider"),
])
def test_every_kind_reads_the_context_key(entry, path, kind):
    parsed = parse_entry(entry)
    assert (parsed.path, parsed.kind, parsed.context) == (path, kind, "solution")
    assert parse_entry(path + (";engine=vllm" if kind == "served" else "")).context is None


@pytest.mark.parametrize("entry", ["http://h:8000;engine=vllm;context=", "/ckpt/teacher;context = ",
                                   "/ckpt/teacher;context=a;context=b"])
def test_a_context_without_a_key_or_given_twice_refused(entry):
    with pytest.raises(ValueError, match=r"names no key|given twice"):
        parse_entry(entry)


class PrefixTeacher:
    """An in-process teacher whose row r depends on its whole prefix: token log-prob
    -sum(ids before the row's token) / 100, the ids 0..K-1 its top-k at that value and value - 1."""

    top_k = K

    def __init__(self, context: str | None = None) -> None:
        self.context, self.seen = context, []

    def score(self, batch: TeacherBatch) -> BatchScores:
        self.seen.append(batch)
        values = [prefix_values(s, start) for s, start in zip(batch.sequences, batch.response_starts)]
        return BatchScores(values, [torch.arange(K).expand(len(v), K).clone() for v in values],
                           [torch.stack([v, v - 1], 1) for v in values], [v - 2 for v in values])


def prefix_values(sequence: torch.Tensor, start: int) -> torch.Tensor:
    sums = sequence.double().cumsum(0)
    return -sums[start - 1:len(sequence) - 1] / 100


def student() -> TeacherBatch:
    return TeacherBatch([torch.tensor([5, 9, 2, 7, 11]), torch.tensor([3, 8, 1])], [2, 1])


HINTS = {"hint": [torch.tensor([1, 2, 3]), [4]], "wrong": [[6, 6], torch.tensor([7])]}


def test_each_teacher_scores_its_own_context_and_rows_line_up():
    teachers = [PrefixTeacher(), PrefixTeacher("hint"), PrefixTeacher("wrong"), PrefixTeacher("hint")]
    step = TeacherStep(teachers, local_host(vocab_size=12))
    step.send(student(), contexts=HINTS)
    scores = step.collect()
    assert [s.tolist() for s in teachers[1].seen[0].sequences] == [[1, 2, 3, 2, 7, 11], [4, 8, 1]]
    assert teachers[1].seen[0].response_starts == [3, 1]
    assert [s.tolist() for s in teachers[2].seen[0].sequences] == [[6, 6, 2, 7, 11], [7, 8, 1]]
    assert teachers[0].seen[0] is step_batch(teachers[0])  # no context: the student's batch itself
    assert teachers[3].seen[0] is teachers[1].seen[0]  # one key: one batch
    expected = {None: [[-0.14, -0.16, -0.23], [-0.03, -0.11]], "hint": [[-0.06, -0.08, -0.15], [-0.04, -0.12]],
                "wrong": [[-0.12, -0.14, -0.21], [-0.07, -0.15]]}
    for teacher, got in zip(teachers, scores):
        assert [t.shape[0] for t in got.token_log_probs] == [3, 2]  # the student's response rows
        for row, want in zip(got.token_log_probs, expected[teacher.context]):
            assert row.tolist() == pytest.approx(want, abs=1e-12)


def step_batch(teacher: PrefixTeacher) -> TeacherBatch:
    return teacher.seen[0]


def test_keyed_and_per_sample_contexts_are_the_same():
    keyed, per_sample = PrefixTeacher("hint"), PrefixTeacher("hint")
    for teacher, contexts in ((keyed, HINTS), (per_sample, [{"hint": [1, 2, 3], "other": "x"}, {"hint": [4]}])):
        step = TeacherStep([teacher], local_host(vocab_size=12))
        step.send(student(), contexts=contexts)
        step.collect()
    assert [s.tolist() for s in keyed.seen[0].sequences] == [s.tolist() for s in per_sample.seen[0].sequences]


@pytest.mark.parametrize(("contexts", "kind", "words"), [
    (None, ValueError, "teacher 1 has context='hint' but no contexts were passed"),
    ({"wrong": HINTS["wrong"]}, ValueError, "teacher 1 has context='hint' but the contexts hold no key 'hint'"),
    ({"hint": [[1]]}, ValueError, "contexts['hint'] holds 1 contexts for a batch of 2 samples"),
    ({"hint": [[1], None]}, ValueError, "sample 1 has no context under 'hint' (None)"),
    ({"hint": [[1], "a hint"]}, TypeError, "sample 1's context under 'hint' is text: tokenize it"),
    ({"hint": [[1], [12]]}, ValueError, "teacher 1's context 'hint': with_context(contexts=...): contexts[1] holds id "
                                        "12, past the teacher's vocabulary of 12"),
    ({"hint": [[1], []]}, ValueError, "contexts[1] is empty"),
    ([{"hint": [1]}, {"other": [2]}], ValueError, "sample 1 has no context under 'hint' (teacher 1 has "
                                                  "context='hint'; the sample holds ['other'])"),
    ([{"hint": [1]}], ValueError, "1 per-sample mappings for a batch of 2 samples"),
    ([{"hint": [1]}, [2]], TypeError, "sample 1's data must be a mapping"),
    ("hint", TypeError, "takes {KEY: [one context per sample]}"),
])
def test_bad_contexts_named_and_the_step_left_ready(contexts, kind, words):
    step = TeacherStep([PrefixTeacher(), PrefixTeacher("hint")], local_host(vocab_size=12))
    with pytest.raises(kind) as error:
        step.send(student(), contexts=contexts)
    assert words in str(error.value)
    step.send(student(), contexts=HINTS)  # nothing was half-sent
    assert len(step.collect()) == 2


def test_a_bad_context_key_on_a_teacher_refused_when_the_step_is_built():
    with pytest.raises(ValueError, match=r"teacher 0 \(PrefixTeacher\).context: .* non-empty str or None, got 3"):
        TeacherStep([PrefixTeacher(3)], local_host(vocab_size=12))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ServedTeacher\(context=...\)"):
        ServedTeacher("http://127.0.0.1:9", "vllm", top_k=K, context="")


def test_a_served_teacher_is_sent_the_privileged_sequence_and_refuses_one_too_long():
    prompts: list = []

    def recording(body):
        prompts.append(body["prompt"])
        return completions(body)

    with vllm_like(v1_completions=recording) as server:
        with ServedTeacher(url_of(server), "vllm", top_k=K, context="hint") as served:
            step = TeacherStep([served, PrefixTeacher()], local_host(vocab_size=12))
            step.send(student(), contexts=HINTS)
            scores, _ = step.collect()
            assert [t.shape[0] for t in scores.token_log_probs] == [3, 2]
            assert [1, 2, 3, 2, 7, 11] in prompts and [4, 8, 1] in prompts
            sent = len(prompts)
            long = {"hint": [torch.arange(MAX_MODEL_LEN - 3) % 12, [4]]}  # + 3 response ids: over the limit
            step.send(student(), contexts=long)
            with pytest.raises(ServedTeacherRefusal, match=r"sample 0 has 64 ids, over .* max model length 64"):
                step.collect()
            assert len(prompts) == sent  # refused before anything was sent


def test_build_teachers_carries_the_entrys_key():
    with vllm_like() as server:
        (served,) = build_teachers(f"{url_of(server)};engine=vllm;same_tokenizer;vocab=12;context=hint",
                                   local_host(vocab_size=12), top_k=K)
        with served:
            assert served.context == "hint"

    def build(entry, options):
        return PrefixTeacher()

    (built,) = build_teachers("/ckpt/teacher;context=solution", LoopHost(12, build_teacher=build), top_k=K)
    assert built.context == "solution"


def model_parallel_pass(teacher: PrefixTeacher, batch: TeacherBatch) -> BatchScores:
    """An in-process teacher's pass with a collective over the job, as a model-parallel one has:
    a rank that skipped it while another ran it would be left waiting."""
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1))
    return teacher.score(batch)


def rank_missing_key(rank: int, world_size: int, url: str) -> dict:
    import torch.distributed as dist

    host = LoopHost(vocab_size=12, share_group=dist.group.WORLD, job_group=dist.group.WORLD,
                    teacher_pass=model_parallel_pass)
    out: dict = {}
    with ServedTeacher(url, "vllm", top_k=K, context="hint") as served:
        step = TeacherStep([PrefixTeacher(), served, PrefixTeacher("hint")], host)
        data = [{"hint": [1, 2, 3]}, {"hint": [4]}]
        step.send(student(), contexts=data)
        out["scores"] = [[t.tolist() for t in s.token_log_probs] for s in step.collect()]
        if rank == 1:
            data = [{"other": [1]}, {"hint": [4]}]  # rank 1's sample 0 lacks the key
        step.send(student(), contexts=data)
        try:
            step.collect()
            out["missing"] = ("", "no error")
        except ServedTeacherRefusal as error:
            out["missing"] = (type(error).__name__, str(error))
        # the served teacher alone: only the asking rank asks, so rank 1's other context would read rank 0's scores
        alone = TeacherStep([served], host)
        mine = [[1, 2, 3], [4]] if rank == 0 else [[1, 2, 5], [4]]
        for case, hints in (("same", [[1, 2, 3], [4]]), ("differ", mine)):
            alone.send(student(), contexts={"hint": hints})
            try:
                out[f"served_{case}"] = ("", [[t.tolist() for t in s.token_log_probs] for s in alone.collect()])
            except ValueError as error:
                out[f"served_{case}"] = (type(error).__name__, str(error))
    return out


@pytest.mark.multirank
def test_a_missing_key_on_one_rank_is_the_same_error_on_every_rank():
    with vllm_like() as server:
        ranks = run_multirank(rank_missing_key, 2, url_of(server))
    assert ranks[0]["scores"] == ranks[1]["scores"]
    assert ranks[0]["missing"] == ranks[1]["missing"]
    words = ranks[0]["missing"][1]
    assert "rank 1" in words and "sample 0 has no context under 'hint'" in words, words
    # a served teacher's contexts compared over the sharing group before its scores are shared
    assert ranks[0]["served_same"] == ranks[1]["served_same"] and ranks[0]["served_same"][0] == ""
    assert ranks[0]["served_differ"] == ranks[1]["served_differ"]
    kind, words = ranks[0]["served_differ"]
    assert kind == "ValueError" and "sent different privileged contexts for served teacher 0 (context 'hint'" in \
        words and "rank 0: lengths [6, 3]" in words and "rank 1: lengths [6, 3]" in words, words


def test_slimes_opd_takes_privileged_teachers_of_another_tokenizer_or_layout_and_refuses_what_it_cannot():
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings

    assert opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/teacher"}) is not None
    served = "http://127.0.0.1:9;engine=vllm;context=solution"
    assert opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": served,
                         "MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teacher"}).teachers[0].context == "solution"
    both = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/hinted;context=solution,student;context=solution"})
    assert [t.context for t in both.teachers] == ["solution", "solution"]
    # another tokenizer takes a context (its own encoding after it: test_slime_opd_cross_tokenizer_lane.py);
    # one key read in two tokenizers is refused, naming both
    crossed = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/teacher,/ckpt/hinted;context=solution;"
                                                                "tokenizer=own"})
    assert [t.context for t in crossed.teachers] == [None, "solution"]
    with pytest.raises(ValueError, match=r"';context=solution' is read by teachers of different tokenizers "
                                         r"\(\['/ckpt/a'\] in the student's tokenizer; \['/ckpt/hinted'\] in "
                                         r"'/ckpt/hinted''s tokenizer\)"):
        opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/a;context=solution,/ckpt/hinted;context=solution;"
                                                          "tokenizer=own"})
    # at its own layout too (its scoring pass over context + response: test_slime_layout_teacher_lane.py)
    layout = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/teacher,/ckpt/hinted;context=solution;tp=2"})
    assert layout.teachers[1].context == "solution" and layout.teachers[1].at_layout
    # K=vocab: each privileged teacher's hidden states from its pass over context + response
    whole = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/hinted;context=solution,student;context=solution,"
                          "http://127.0.0.1:9;engine=vllm;head=/ckpt/head;context=solution",
                          "MEGATRON_RL_PATCHES_OPD_K": "vocab"})
    assert whole.full_vocab and [t.context for t in whole.teachers] == ["solution"] * 3


def test_a_served_heads_context_is_checked_against_the_heads_vocabulary():
    """A served teacher with a head (its own tokenizer's vocabulary, here smaller than the
    student's): its context ids are checked against the head's, before anything is sent."""
    from megatron_rl_patches.teachers import TeacherHead

    head = TeacherHead(torch.zeros(50, 8), 50, 50, 0, source="in-memory")
    with ServedTeacher("http://127.0.0.1:9", head=head, top_k=1, context="hint") as teacher:
        step = TeacherStep([teacher], local_host(64))
        with pytest.raises(ValueError, match=r"teacher 0's context 'hint'.*holds id 55, past the teacher's "
                                             r"vocabulary of 50"):
            step.send(student(), contexts={"hint": [[55], [3]]})
