"""The worked top-k OPD example (examples/topk_opd_cpu.py) on real megatron-core GPT models: the
loss falls, the teachers stay inference-only and untouched, and only the student gets gradients."""
import importlib.util
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.reader_facing]  # main and newest lanes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "topk_opd_cpu.py"
STEPS = 4


@pytest.fixture(scope="module")
def example():
    pytest.importorskip("megatron.core")
    spec = importlib.util.spec_from_file_location("topk_opd_cpu", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def run(example):
    """One in-process run of main(); the on_step hook snapshots what each step left behind."""
    records, grads = [], []

    def on_step(record):
        records.append(record)
        grads.append(
            (
                {name: None if p.grad is None else p.grad.clone() for name, p in record.student.named_parameters()},
                [[p.grad for p in teacher.parameters()] for teacher in record.teachers],
            )
        )

    losses = example.main(steps=STEPS, seed=0, on_step=on_step)
    return losses, records, grads


def test_the_loss_falls_and_bounds_the_full_kl_from_below(run):
    losses, records, _ = run
    assert len(losses) == STEPS and all(math.isfinite(loss) and loss > 0 for loss in losses)
    assert losses == [r.loss for r in records]
    assert losses[-1] < 0.6 * losses[0], losses
    full = [r.full_kl for r in records]
    assert full[-1] < 0.85 * full[0], full
    # coarsening to k + 1 buckets cannot raise a KL (data-processing inequality)
    assert all(r.loss <= r.full_kl + 1e-5 for r in records), [(r.loss, r.full_kl) for r in records]
    assert all(0.0 < r.teacher_mass < 1.0 for r in records)


def test_teachers_are_inference_only_and_unchanged(example, run):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_rl_patches.inference import is_inference_only
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    _, records, _ = run
    teachers = records[-1].teachers
    assert len(teachers) == len(example.TEACHER_WEIGHTS) == 2
    for teacher in teachers:
        assert isinstance(teacher, GPTModel) and not isinstance(teacher, DistributedDataParallel)
        assert is_inference_only(teacher) and not teacher.training
        assert not hasattr(teacher, "buffers_by_param") and not hasattr(teacher, "ddp_config")
        assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    with megatron_on_cpu():
        fresh = example.build_teachers(100)  # main(seed=0) builds them from seed + 100
    for teacher, built in zip(teachers, fresh):
        for (name, p), q in zip(teacher.named_parameters(), built.parameters()):
            assert torch.equal(p, q), f"teacher weight {name} changed during distillation"


def test_gradients_reach_only_the_student(example, run):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_rl_patches.inference import is_inference_only
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    _, records, grads = run
    student = records[-1].student
    assert isinstance(student, GPTModel) and not is_inference_only(student)
    for student_grads, teacher_grads in grads:
        assert student_grads and all(
            g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in student_grads.values()
        ), [name for name, g in student_grads.items() if g is None or not g.abs().sum() > 0]
        assert all(g is None for per_teacher in teacher_grads for g in per_teacher)
    with megatron_on_cpu():
        initial = example.build_student(0)
    moved = [not torch.equal(p, q) for p, q in zip(student.parameters(), initial.parameters())]
    assert all(moved), "every student weight should have been updated by Adam"


def test_script_prints_the_loss_table(example, run, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--steps", "2", "--seed", "0"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].split()[:3] == ["step", "top-k", "loss"]
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["0", "1"]
    assert float(rows[1][1]) < float(rows[0][1])
    # same seed, same run: the table shows what main() returns
    assert [float(row[1]) for row in rows] == pytest.approx(run[0][:2], abs=1e-4)


def test_bad_arguments_are_rejected_before_any_work(example):
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        example.main(steps=0)
    with pytest.raises(TypeError, match="seed must be an int, got float"):
        example.main(steps=1, seed=0.5)
    assert not torch.distributed.is_initialized()
