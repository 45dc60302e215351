"""The served-teacher example (examples/served_teacher_loop.py, issue 72 item 10a) against the
session's real vLLM server (conftest): a tiny GPTModel student in a hand-written loop at 1 and 2
ranks (TP=2). Each step's loss equals a float64 reference computed here from the same served
scores and the student's own logits, rows placed independently of the example (a one-position
shift away it misses); both ranks counts give the same losses; the optimizer moves the student;
and the script runs as its docstring says, serving its own teacher. (Runs before
test_served_vllm.py, whose last test stops the server.)"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.teachers.lane.early_work import Job, offer
from tests.teachers.lane.example_kit import bucket_kl, student_log_softmax
from tests.teachers.lane.served_kit import VLLM_PYTHON, VOCAB

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
STEPS = 3
TOLERANCE = 1e-6  # the student's fp32 forward against float64 (5e-8 measured)


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLES))  # the ranks (spawned) import it by this name too: sys.path goes along
    try:
        import served_teacher_loop

        yield served_teacher_loop
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.modules.pop("served_teacher_loop", None)


def float64_reference(inputs) -> dict:
    """`on_loss`: the step's loss recomputed in float64 from the student's whole logits (gathered
    over the tensor-parallel ranks) and the served scores; sample i's row r read at position
    start_i + r - 1, and (the negative control) one position earlier."""
    rows = student_log_softmax(inputs)
    kl: dict[str, list[torch.Tensor]] = {"reference": [], "shifted": []}
    for i, (ids, start) in enumerate(zip(inputs.samples.sequences, inputs.samples.response_starts)):
        served = (inputs.scores.topk_ids[i], inputs.scores.topk_log_probs[i].double(),
                  inputs.scores.tail_log_probs[i].double())
        kl["reference"].append(bucket_kl(rows[i, start - 1:len(ids) - 1], *served))
        kl["shifted"].append(bucket_kl(rows[i, start - 2:len(ids) - 2], *served))  # every prompt has >= 2 ids
    return {name: float(torch.cat(values).mean()) for name, values in kl.items()} | {
        "loss": float(inputs.loss), "weight": float(inputs.student.output_layer.weight.double().sum())}


@pytest.fixture(scope="module")
def runs(served, example):
    return {tp: example.main(served.url, VOCAB, tp=tp, steps=STEPS, on_loss=float64_reference) for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
def test_each_steps_loss_is_the_float64_bucket_kl_of_the_same_served_scores(runs, tp):
    worst, control = 0.0, float("inf")
    for record in runs[tp]:
        checked = record["checked"]
        assert record["loss"] == pytest.approx(checked["loss"], abs=1e-7)
        error = abs(checked["loss"] - checked["reference"])
        assert error <= TOLERANCE, (tp, record)
        worst, control = max(worst, error), min(control, abs(checked["shifted"] - checked["reference"]))
    assert control > 10 * TOLERANCE  # rows read one position off miss: the placing is what it checks
    print(f"TP={tp}: the loss vs float64 from the same served scores: max |error| {worst:.1e} "
          f"(one position off: >= {control:.1e})")


def test_one_and_two_ranks_train_alike_and_the_optimizer_moves_the_student(runs, example):
    responses = sum(n - p for n, p in zip(example.LENGTHS, example.PROMPTS))
    for one, two in zip(runs[1], runs[2]):
        assert one["rows"] == two["rows"] == responses
        assert one["loss"] == pytest.approx(two["loss"], abs=1e-5)
    for records in runs.values():
        weights = [record["checked"]["weight"] for record in records]
        assert len(set(weights)) == STEPS  # each step's optimizer step moved the output layer


# the example's two command lines as pasted (the script's docstring): each serves its own teacher
AS_PASTED = {"top-k": ("--tp", "2", "--steps", "2"), "head": ("--head", "--tp", "2", "--steps", "1")}


def begin_as_pasted(root: Path, _directory: Path) -> dict[str, tuple[subprocess.Popen, Any, Any]]:
    """Both command lines of `AS_PASTED` started together in fresh interpreters, so their two vLLM
    servers load side by side: {name: (its process, its stdout file, its stderr file)}."""
    folder = root / "as-pasted"
    folder.mkdir(exist_ok=True)
    started = {}
    try:
        for name, options in AS_PASTED.items():
            out, err = (open(folder / f"{name}.{kind}", "w+") for kind in ("out", "err"))
            command = [sys.executable, str(EXAMPLES / "served_teacher_loop.py"), "--vllm-python", VLLM_PYTHON,
                       *options]
            started[name] = (subprocess.Popen(command, stdout=out, stderr=err, text=True,
                                              env={**os.environ, "PYTHONWARNINGS": "ignore"}), out, err)
    except BaseException:
        end_as_pasted(started)
        raise
    return started


def settle_as_pasted(started: dict[str, tuple[subprocess.Popen, Any, Any]], timeout: float = 600.0) -> None:
    """Until each run's server is up (the script prints "served at URL") or the run has ended: the
    servers' load is the runs' peak (their ranks, about 1 GB a run, fit the lane's reserve)."""
    until = time.monotonic() + timeout
    for proc, out, _ in started.values():
        while proc.poll() is None and "served at " not in Path(out.name).read_text() and time.monotonic() < until:
            time.sleep(0.5)


def end_as_pasted(started: dict[str, tuple[subprocess.Popen, Any, Any]]) -> None:
    for proc, out, err in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close(), err.close()


# the two runs as pasted go while the lane's other tests run (early_work): each a vLLM server of its
# own and a world of two ranks, about one and a half servers' peak
offer("example as pasted", Job(__name__, 3, begin_as_pasted, settle_as_pasted, end_as_pasted))


@pytest.fixture(scope="module")
def as_pasted(early_work):
    """The runs of `begin_as_pasted` (begun early, or when the first is asked for); each test takes
    its own run's (returncode, stdout, stderr)."""
    started = early_work.take("example as pasted")

    def finished(name: str) -> subprocess.CompletedProcess:
        proc, out, err = started[name]
        proc.wait(timeout=900)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())

    try:
        yield finished
    finally:
        end_as_pasted(started)


def test_the_script_runs_as_pasted_serving_its_own_teacher(runs, as_pasted):
    """`python examples/served_teacher_loop.py --vllm-python ... --tp 2` in a fresh interpreter: its
    own server of the same tiny teacher (the lane's shape), the same losses as the in-process run."""
    proc = as_pasted("top-k")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [line.split() for line in proc.stdout.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [row[0] for row in table] == ["0", "1"], proc.stdout
    assert [float(row[1]) for row in table] == pytest.approx([r["loss"] for r in runs[2][:2]], abs=1e-4)


def float64_every(inputs) -> dict:
    """`on_loss` of a run with the in-process teacher beside the served one: the step's loss
    recomputed in float64 as the mean over the teachers of each one's bucket KL (the student's whole
    logits at that teacher's own ids), and the teachers' count."""
    rows = student_log_softmax(inputs)
    means = []
    for scores in inputs.every:
        kl = [bucket_kl(rows[i, start - 1:len(ids) - 1], scores.topk_ids[i], scores.topk_log_probs[i].double(),
                        scores.tail_log_probs[i].double())
              for i, (ids, start) in enumerate(zip(inputs.samples.sequences, inputs.samples.response_starts))]
        means.append(torch.cat(kl).mean())
    return {"reference": float(torch.stack(means).mean()), "teachers": len(inputs.every),
            "same_ids": all(torch.equal(a, b) for a, b in zip(*(s.topk_ids for s in inputs.every)))}


def test_an_in_process_teacher_beside_the_served_one_at_one_and_two_ranks(served, example):
    """`main(url, ..., in_process=True)`: the served and the in-process teacher on one teacher step;
    each step's loss the mean of their float64 bucket KLs, the same at TP=1 and TP=2."""
    runs = {tp: example.main(served.url, VOCAB, tp=tp, steps=2, in_process=True, on_loss=float64_every)
            for tp in (1, 2)}
    for one, two in zip(runs[1], runs[2]):
        assert one["loss"] == pytest.approx(two["loss"], abs=1e-5)
    for records in runs.values():
        for record in records:
            assert record["checked"]["teachers"] == 2 and not record["checked"]["same_ids"]  # two teachers' own ids
            assert abs(record["loss"] - record["checked"]["reference"]) <= TOLERANCE, record


def float64_head(inputs) -> dict:
    """`on_loss` of the whole-vocabulary route (`--head`): the step's forward KL recomputed in
    float64 over the real vocabulary from the student's whole logits and the served states through
    the teacher's whole head; sample i's state r read at position start_i + r - 1, and (the negative
    control) the states one position off."""
    from tests.teachers.lane.example_kit import teacher_log_softmax

    rows = student_log_softmax(inputs)
    kl: dict[str, list[torch.Tensor]] = {"reference": [], "shifted": []}
    for i, start in enumerate(inputs.samples.response_starts):
        teacher = teacher_log_softmax(inputs.scores.hidden_states[i], inputs.teacher_weight, inputs.vocab_size)
        for name, at in (("reference", start - 1), ("shifted", start - 2)):
            student = rows[i, at:at + teacher.shape[0]]
            kl[name].append((teacher.exp() * (teacher - student)).sum(-1))
    return {name: float(torch.cat(values).mean()) for name, values in kl.items()} | {
        "loss": float(inputs.loss), "rows": tuple(inputs.teacher_weight.shape)}


@pytest.fixture(scope="module")
def head_runs(pooled, example):
    return {tp: example.main(pooled.url, VOCAB, tp=tp, steps=2, on_loss=float64_head, head=str(pooled.directory))
            for tp in (1, 2)}


def test_the_whole_vocabulary_route_at_one_and_two_ranks_against_float64(head_runs):
    """`main(url, ..., head=DIR)` against the lane's pooling server: the served states through the
    teacher's head (this rank's shard at the student's padded layout: 1024 rows, 512 at TP=2) in
    `divergence_output_processor`; each step's loss the float64 forward KL over the whole
    vocabulary, the same at TP=1 and TP=2, and states one position off miss it."""
    runs = head_runs
    for tp, records in runs.items():
        for record in records:
            checked = record["checked"]
            assert checked["rows"] == (1024 // tp, 64), checked
            assert abs(record["loss"] - checked["reference"]) <= TOLERANCE, (tp, record)
            assert abs(checked["shifted"] - checked["reference"]) > 10 * TOLERANCE, (tp, record)
        print(f"TP={tp} --head: the loss vs float64 over the whole vocabulary: max |error| "
              f"{max(abs(r['loss'] - r['checked']['reference']) for r in records):.1e}")
    for one, two in zip(runs[1], runs[2]):
        assert one["loss"] == pytest.approx(two["loss"], abs=1e-5)
    assert runs[1][0]["loss"] != runs[1][1]["loss"]  # the optimizer moved the student


def test_the_whole_vocabulary_script_runs_as_pasted_serving_its_own_teacher(head_runs, as_pasted):
    """The docstring's `.venv/bin/python examples/served_teacher_loop.py --vllm-python ... --head --tp 2`
    in a fresh interpreter: its own pooling server of the same tiny teacher, the same loss."""
    proc = as_pasted("head")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "whole vocabulary" in proc.stdout, proc.stdout
    table = [line.split() for line in proc.stdout.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [float(row[1]) for row in table] == pytest.approx([head_runs[2][0]["loss"]], abs=1e-4)
