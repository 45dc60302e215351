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
from pathlib import Path

import pytest
import torch

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


def bucket_kl(student_rows: torch.Tensor, ids: torch.Tensor, teacher_logp: torch.Tensor,
              teacher_tail: torch.Tensor) -> torch.Tensor:
    """Float64 forward KL over the k + 1 buckets per row: the student's full log-softmax rows at the
    served ids, the tail its exact complement; the teacher's served values as given."""
    p = student_rows.gather(1, ids).exp()
    p = torch.cat([p, 1 - p.sum(1, keepdim=True)], dim=1)
    q = torch.cat([teacher_logp.exp(), teacher_tail.exp()[:, None]], dim=1)
    return (q * (q.log() - p.log())).sum(1)


def float64_reference(inputs) -> dict:
    """`on_loss`: the step's loss recomputed in float64 from the student's whole logits (gathered
    over the tensor-parallel ranks) and the served scores; sample i's row r read at position
    start_i + r - 1, and (the negative control) one position earlier."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from served_teacher_loop import student_forward

    group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        logits = student_forward(inputs.student, inputs.tokens)  # [b, s, V_padded / tp]
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
    rows = torch.log_softmax(torch.cat(parts, dim=-1)[..., :inputs.vocab_size].double(), dim=-1)
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


def test_the_script_runs_as_pasted_serving_its_own_teacher(runs):
    """`python examples/served_teacher_loop.py --vllm-python ... --tp 2` in a fresh interpreter: its
    own server of the same tiny teacher (the lane's shape), the same losses as the in-process run."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "served_teacher_loop.py"), "--vllm-python", VLLM_PYTHON,
                           "--tp", "2", "--steps", "2"], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [line.split() for line in proc.stdout.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [row[0] for row in table] == ["0", "1"], proc.stdout
    assert [float(row[1]) for row in table] == pytest.approx([r["loss"] for r in runs[2][:2]], abs=1e-4)
