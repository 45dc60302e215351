"""A ResidencyBudget shared by several teachers: the device weight bytes of all of them, counted
from their parameters' storages at every layer of a real multi-teacher step, never exceed it;
least-recently-used teachers are evicted; a teacher larger than the budget streams instead."""
from __future__ import annotations

import logging

import pytest
import torch

from megatron_rl_patches import ResidencyBudget, build_inference_model, on_device, residency_report
from megatron_rl_patches.inference.residency.storage import device_weight_bytes

pytestmark = pytest.mark.megatron


def _teacher(env, layers, residency="swap", **kwargs):
    return build_inference_model(env.model_provider(env.config(num_layers=layers), seed=layers), residency=residency,
                                 **kwargs)


def _nbytes(chunks) -> int:
    return sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())


def _device_bytes(teachers) -> int:
    return sum(device_weight_bytes(p for c in chunks for p in c.parameters()) for chunks in teachers)


def _watch_all(teachers, seen: list[int]) -> None:
    def record(module, args):
        seen.append(_device_bytes(teachers))

    for chunks in teachers:
        for module in chunks[0].modules():
            if not list(module.children()):
                module.register_forward_pre_hook(record)


def test_three_teachers_never_exceed_the_budget_in_a_multi_teacher_step(megatron_cpu):
    env = megatron_cpu
    sizes = (1, 2, 3)
    references = [_teacher(env, n, "resident") for n in sizes]
    largest = max(_nbytes(r) for r in references)
    budget = ResidencyBudget(largest + _nbytes(references[0]))  # room for the largest and the smallest
    teachers = [_teacher(env, n, budget=budget) for n in sizes]
    assert _device_bytes(teachers) == 0
    seen: list[int] = []
    _watch_all(teachers, seen)
    batch = env.batch(seed=1)
    for _step in range(2):
        for chunks, reference in zip(teachers, references):
            with on_device(chunks):
                out = env.forward(chunks[0], batch)
            assert torch.equal(out, env.forward(reference[0], batch))
            assert _device_bytes(teachers) <= budget.bytes
    assert seen and max(seen) <= budget.bytes
    assert budget.peak <= budget.bytes and budget.in_use == _device_bytes(teachers)
    assert budget.evictions > 0
    # one model stays cached between phases when room allows: the smallest after the largest ran
    reports = [residency_report(chunks) for chunks in teachers]
    assert all(r.budget is not None and r.budget["bytes"] == budget.bytes for r in reports)


def test_lru_keeps_the_recently_used_teacher(megatron_cpu):
    env = megatron_cpu
    a_ref, b_ref = _teacher(env, 1, "resident"), _teacher(env, 2, "resident")
    budget = ResidencyBudget(_nbytes(a_ref) + _nbytes(b_ref))  # two fit, three do not
    a, b, c = (_teacher(env, n, budget=budget) for n in (1, 2, 2))
    batch = env.batch(seed=2)
    for chunks in (a, b, a):
        env.forward(chunks[0], batch)
    assert residency_report(a).copies == 1  # stayed cached between its two uses
    env.forward(c[0], batch)  # evicts b (least recently used), keeps a
    assert device_weight_bytes(b[0].parameters()) == 0
    assert device_weight_bytes(a[0].parameters()) == _nbytes(a)
    assert budget.in_use == _nbytes(a) + _nbytes(c) <= budget.bytes


def test_a_teacher_larger_than_the_budget_streams(megatron_cpu, caplog):
    env = megatron_cpu
    reference = _teacher(env, 5, "resident")
    layer = sum(p.numel() * p.element_size() for p in reference[0].decoder.layers[0].parameters())
    budget = ResidencyBudget(_nbytes(reference) // 2)
    assert budget.bytes >= 2 * layer
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        chunks = _teacher(env, 5, budget=budget)
    assert [r.message for r in caplog.records if "streaming it layer by layer" in r.message]
    assert residency_report(chunks).mode == "stream"
    batch = env.batch(seed=3)
    assert torch.equal(env.forward(chunks[0], batch), env.forward(reference[0], batch))
    assert 0 < budget.peak <= budget.bytes


def test_full_budget_is_a_clear_error(megatron_cpu):
    env = megatron_cpu
    small = _teacher(env, 1, "resident")
    budget = ResidencyBudget(_nbytes(small))
    a, b = _teacher(env, 1, budget=budget), _teacher(env, 1, budget=budget)
    with on_device(a):
        with pytest.raises(RuntimeError, match="ResidencyBudget of \\d+ bytes is full"):
            env.forward(b[0], env.batch(seed=4))
    assert device_weight_bytes(b[0].parameters()) == 0
