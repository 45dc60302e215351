"""The demo's memory figures: what the inference-only teachers did not allocate, and the bytes the
log-prob path keeps for backward compared with naive autograd."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from megatron_rl_patches.bench.common import SavedBytes
from megatron_rl_patches.demo.loop import DemoConfig
from megatron_rl_patches.testing import megatron_cpu as kit


def counted_training_state_bytes(model: Any) -> dict[str, int]:
    """Bytes a trainable build of `model`'s architecture really allocates beyond its weights:
    megatron-core's DDP grad buffer and its Adam optimizer state (after one step allocates it),
    with the formula's total for the same build beside them."""
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
    return {
        "count": len(teachers),
        "params_per_teacher": params,
        "trainable_build_bytes_per_teacher": trainable,
        "formula_bytes_per_teacher": formula,
        "allocated_bytes": held,
        "saved_bytes": len(teachers) * trainable["total"] - held,
    }


def logprob_saved_bytes(cfg: DemoConfig, tokens_per_batch: int = 512) -> dict[str, int]:
    """Bytes saved for backward on one [T, V] batch: naive autograd vs ours (entropy as a metric,
    and with an entropy gradient). The logits are counted when they are saved."""
    from megatron_rl_patches import log_probs_and_entropy

    gen = torch.Generator().manual_seed(cfg.seed)
    logits = torch.randn(tokens_per_batch, cfg.vocab_size, generator=gen, requires_grad=True)
    targets = torch.randint(0, cfg.vocab_size, (tokens_per_batch,), generator=gen)

    def naive() -> Any:
        logp_all = torch.log_softmax(logits, dim=-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy

    def saved_bytes(fn: Callable[[], Any]) -> int:
        with SavedBytes() as saved:
            fn()
        return saved.bytes

    return {
        "tokens": tokens_per_batch,
        "vocab": cfg.vocab_size,
        "naive": saved_bytes(naive),
        "ours_entropy_metric": saved_bytes(
            lambda: log_probs_and_entropy(logits, targets, with_entropy=True, entropy_requires_grad=False)
        ),
        "ours_entropy_grad": saved_bytes(lambda: log_probs_and_entropy(logits, targets, with_entropy=True)),
    }
