"""The demo's memory figures: what the inference-only teachers did not allocate, and the
[T, V] logits the logits route allocates per micro-batch."""
# lazy imports: import cost: the plain route imports no piece of the package (tests/apps/demo)
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl_patches.apps.demo.loop import DemoConfig
from megatron_rl_patches.testing import megatron_cpu as kit


def counted_training_state_bytes(model: Any) -> dict[str, int]:
    """Bytes a trainable build of `model`'s architecture really allocates beyond its weights:
    megatron-core's DDP grad buffer and its Adam optimizer state (after one step allocates it),
    with the formula's total for the same build beside them."""
    # lazy: optional dependency megatron-core
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl_patches import training_state_bytes

    ddp = kit.wrap_ddp(model, use_distributed_optimizer=False)  # model already on its device
    report = training_state_bytes(ddp)
    grad_buffer = report.counted_grad_buffer
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), [ddp])
    optimizer.step()  # Adam allocates m and v on its first step
    inner = [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    state = sum(
        value.numel() * value.element_size()
        for opt in inner
        for per_param in opt.state.values()
        for value in per_param.values()
        if torch.is_tensor(value) and value.dim() > 0
    )
    return {"grad_buffer": grad_buffer, "optimizer_state": state, "total": grad_buffer + state,
            "formula": report.total, "params": report.num_params}


def _allocated_training_state(chunk: Any) -> int:
    """Bytes of grads / main_grads an (inference) chunk holds: 0 when built right."""
    total = 0
    for param in chunk.parameters():
        for grad in (param.grad, getattr(param, "main_grad", None)):
            if grad is not None:
                total += grad.numel() * grad.element_size()
    return total


def teacher_savings(teachers: Sequence[Any], cfg: DemoConfig) -> dict[str, Any]:
    """What the inference-only teachers hold vs a trainable build of the same architecture."""
    trainable = counted_training_state_bytes(
        kit.build_tiny_gpt(vocab_size=cfg.vocab_size, seq_length=cfg.seq_length, seed=cfg.seed).to(cfg.device)
    )
    params = sum(p.numel() for p in teachers[0].parameters())
    if params != trainable.pop("params"):
        raise RuntimeError("the trainable build measured is not the teachers' architecture")
    formula = trainable.pop("formula")
    held = sum(_allocated_training_state(t) for t in teachers)
    from megatron_rl_patches import residency_report

    reports = [residency_report(t) for t in teachers]
    return {
        "residency": {
            "mode": reports[0].mode,
            "peak_device_weight_bytes": sum(r.peak_device_weight_bytes for r in reports),
            "resident_weight_bytes": sum(r.resident_weight_bytes for r in reports),
            "host_bytes": sum(r.host_bytes for r in reports),
        },
        "count": len(teachers),
        "params_per_teacher": params,
        "trainable_build_bytes_per_teacher": trainable,
        "formula_bytes_per_teacher": formula,
        "allocated_bytes": held,
        "saved_bytes": len(teachers) * trainable["total"] - held,
    }


def logits_bytes_per_microbatch(cfg: DemoConfig) -> dict[str, int]:
    """fp32 [b*s, V] logits the logits route allocates per micro-batch: the actor's training
    forward, its old-policy forward while scoring, and one forward per teacher."""
    one = cfg.micro_batch_size * cfg.seq_length * cfg.vocab_size * 4
    return {"one_forward": one, "actor": 2 * one, "teachers": cfg.teachers * one, "total": (2 + cfg.teachers) * one}
