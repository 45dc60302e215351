"""A privileged context has one owner (issue 87 item 3): the teacher step reads each teacher's key
once, when it is built, and passes it on as an argument; `build_teachers` gives a host-built
teacher its entry's `;context=KEY` through the one wrapper, `Privileged(teacher, KEY)`, and never
changes the host's teacher (a teacher that takes no attribute builds as well)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers import BatchScores, LoopHost, TeacherBatch, TeacherStep, build_teachers
from megatron_rl_patches.teachers.context.privileged import Privileged

K = 2
VOCAB = 12
STUDENT = TeacherBatch([torch.tensor([5, 9, 2, 7]), torch.tensor([3, 8, 1])], [2, 1])
HINTS = {"hint": [[1, 2, 3], [4]]}
HINTED = [pytest.approx([-0.06, -0.08]), pytest.approx([-0.04, -0.12])]  # prefix_scores on context + response


def prefix_scores(batch: TeacherBatch) -> BatchScores:
    """Row r's token log-prob: -(sum of the ids before the row's token) / 100 (the context shows)."""
    values = [-s.double().cumsum(0)[start - 1:len(s) - 1] / 100 for s, start in zip(batch.sequences,
                                                                                   batch.response_starts)]
    return BatchScores(values, [torch.arange(K).expand(len(v), K).clone() for v in values],
                       [torch.stack([v, v - 1], 1) for v in values], [v - 2 for v in values])


class Plain:
    """A host's in-process teacher with no key of its own; it notes each batch it scores."""

    top_k = K

    def __init__(self) -> None:
        self.seen: list[TeacherBatch] = []

    def score(self, batch: TeacherBatch) -> BatchScores:
        self.seen.append(batch)
        return prefix_scores(batch)


class Fixed:
    """A host's teacher that takes no attribute at all."""

    __slots__ = ()
    top_k = K

    def score(self, batch: TeacherBatch) -> BatchScores:
        return prefix_scores(batch)


class Counted(Plain):
    """A teacher whose own key counts how often it is read."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key, self.reads = key, 0

    @property
    def context(self) -> str:
        self.reads += 1
        return self.key


def test_build_teachers_wraps_the_hosts_teacher_and_leaves_it_untouched():
    made: list[tuple[Plain, dict]] = []

    def build(entry, options):
        made.append((Plain(), {}))
        made[-1][1].update(vars(made[-1][0]))
        return made[-1][0]

    plain, privileged = build_teachers("/ckpt/a,/ckpt/b;context=hint", LoopHost(VOCAB, build_teacher=build), top_k=K)
    assert plain is made[0][0]  # no key: the host's teacher itself
    assert isinstance(privileged, Privileged) and privileged.teacher is made[1][0] and privileged.context == "hint"
    for teacher, before in made:
        assert vars(teacher) == before and not hasattr(teacher, "context")  # never changed by the build
    step = TeacherStep([plain, privileged], LoopHost(VOCAB))
    step.send(STUDENT, contexts=HINTS)
    got = step.collect()
    assert [s.tolist() for s in made[1][0].seen[0].sequences] == [[1, 2, 3, 2, 7], [4, 8, 1]]
    assert made[0][0].seen[0] is STUDENT
    assert [t.tolist() for t in got[1].token_log_probs] == HINTED


def test_a_host_teacher_that_takes_no_attribute_builds_with_its_context():
    (built,) = build_teachers("/ckpt/t;context=hint", LoopHost(VOCAB, build_teacher=lambda entry, options: Fixed()),
                              top_k=K)
    step = TeacherStep([built], LoopHost(VOCAB))
    step.send(STUDENT, contexts=HINTS)
    (got,) = step.collect()
    assert [t.tolist() for t in got.token_log_probs] == HINTED


def test_the_step_reads_each_teachers_key_once_when_built():
    teacher = Counted("hint")
    step = TeacherStep([teacher, Privileged(Plain(), "hint")], LoopHost(VOCAB))
    assert teacher.reads == 1 and step.keys == ["hint", "hint"]
    for _ in range(2):
        step.send(STUDENT, contexts=HINTS)
        step.collect()
    teacher.key = "other"  # the step's key is its own: a later change of the teacher's is not read
    step.send(STUDENT, contexts=HINTS)
    step.collect()
    assert teacher.reads == 1
    assert [s.tolist() for s in teacher.seen[-1].sequences] == [[1, 2, 3, 2, 7], [4, 8, 1]]


@pytest.mark.parametrize(("make", "error", "words"), [
    (lambda: Privileged(Plain(), None), ValueError, r"Privileged\(context=None\): a teacher without a privileged "
                                                    r"context is the teacher itself"),
    (lambda: Privileged(Plain(), " "), ValueError, r"Privileged\(context=...\): the key .* non-empty str or None"),
    (lambda: Privileged(Privileged(Plain(), "a"), "b"), TypeError, r"is already Privileged\(.*context='a'\): give a "
                                                                   r"teacher one key"),
])
def test_privileged_refuses_a_missing_key_and_a_second_one(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_privileged_closes_the_teacher_it_wraps():
    class Closing(Plain):
        closed = False

        def close(self) -> None:
            self.closed = True

    inner = Closing()
    Privileged(inner, "hint").close()
    Privileged(Plain(), "hint").close()  # a teacher without close(): nothing to do
    assert inner.closed


def test_slimes_in_process_privileged_teachers_are_the_one_wrapper():
    """slime's OPD gives an in-process teacher of a `;context=KEY` entry its key through
    `teachers.Privileged` too (its `PrivilegedTeacher` is one), the loaded teacher untouched."""
    from megatron_rl_patches.integrations.megatron.opd.opd_teachers import SeparateTeacher
    from megatron_rl_patches.integrations.megatron.opd.privileged import StudentChunksPass
    from megatron_rl_patches.integrations.megatron.opd.teacher_builders import given_context
    from megatron_rl_patches.teachers.kinds import parse_entry

    live, chunks = StudentChunksPass(), SeparateTeacher(["chunk"])
    for loaded, entry in ((live, "student;context=hint"), (chunks, "/ckpt/theta0;context=hint")):
        wrapped = given_context(loaded, parse_entry(entry))
        assert isinstance(wrapped, Privileged) and wrapped.teacher is loaded and wrapped.context == "hint"
        assert not hasattr(loaded, "context")
    assert given_context(live, parse_entry("/ckpt/theta0")) is live  # no key: as loaded


def test_a_served_teacher_given_its_key_by_the_wrapper_is_asked_for_the_privileged_sequences():
    from megatron_rl_patches.teachers import ServedTeacher
    from tests.teachers.local_servers import completions, url_of, vllm_like

    prompts: list = []

    def recording(body):
        prompts.append(body["prompt"])
        return completions(body)

    with vllm_like(v1_completions=recording) as server, ServedTeacher(url_of(server), "vllm", top_k=K) as served:
        step = TeacherStep([Privileged(served, "hint")], LoopHost(VOCAB))
        assert step.keys == ["hint"] and served.context is None  # the served teacher itself untouched
        step.send(STUDENT, contexts=HINTS)
        (got,) = step.collect()
    assert [1, 2, 3, 2, 7] in prompts and [4, 8, 1] in prompts  # context + response, not the student's own
    assert [5, 9, 2, 7] not in prompts and [3, 8, 1] not in prompts
    assert [t.shape[0] for t in got.token_log_probs] == [2, 2]  # the student's response rows
