"""The NeMo-RL lane's ranks for a served teacher: NeMo-RL 7ea279ab's own Megatron driver with its
`LossPostProcessor` over its real `DistillationLossFn` (on `nemo_rl_topk_kd`) on a batch whose
`teacher_topk_logits` / `teacher_topk_indices` came from a real vLLM server through
`ServedTeacherPolicy`, its loss and gradients against a float64 reference (the exact (k+1)-bucket
KL from NeMo-RL's own unpatched student log-probs), and a control with the teacher's rows one
position off. Imported in each spawned rank: the service stand-ins are installed first."""
from __future__ import annotations

import itertools
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from megatron_rl_patches.testing.service_stubs import install_service_stubs  # noqa: E402

install_service_stubs()

import nemo_kit as kit  # noqa: E402
import torch  # noqa: E402

KL_TYPES = ("forward", "reverse", "mixed")
MIXED_WEIGHT = 0.3


def exact_kl(student: torch.Tensor, teacher: torch.Tensor, kl_type: str) -> torch.Tensor:
    """[..] the (k+1)-bucket KL in float64 from whole-vocabulary top-k log-probs of both sides."""
    p, q = student.double(), teacher.double()
    p = torch.cat([p, torch.log1p(-p.exp().sum(-1).clamp(max=1 - 1e-12))[..., None]], -1)
    q = torch.cat([q, torch.log1p(-q.exp().sum(-1).clamp(max=1 - 1e-12))[..., None]], -1)
    forward = (q.exp() * (q - p)).sum(-1)
    reverse = (p.exp() * (p - q)).sum(-1)
    if kl_type == "forward":
        return forward
    if kl_type == "reverse":
        return reverse
    return MIXED_WEIGHT * forward + (1 - MIXED_WEIGHT) * reverse


class Float64Reference:
    """A NeMo-RL distillation loss (its interface) computing the exact (k+1)-bucket KL in float64
    from NeMo-RL's own student log-probs over the whole vocabulary at the teacher's ids
    (`zero_outside_topk=True`) and the batch's raw served teacher log-probs (not NeMo-RL's
    renormalized ones)."""

    def __init__(self, kl_type: str) -> None:
        from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType

        self.loss_type, self.input_type = LossType.TOKEN_LEVEL, LossInputType.DISTILLATION
        self.kl_type, self.zero_outside_topk, self.mixed_kl_weight = kl_type, True, MIXED_WEIGHT

    def __call__(self, *, student_topk_logprobs, data, global_valid_toks, **_ignored):
        from nemo_rl.algorithms.utils import masked_mean

        length = student_topk_logprobs.shape[1]
        teacher = data["teacher_topk_logits"][:, :length].double()
        per_token = exact_kl(student_topk_logprobs, teacher, self.kl_type)
        mask = data["token_mask"][:, 1:][:, :length] * data["sample_mask"].unsqueeze(-1)
        loss = masked_mean(per_token, mask.double(), global_normalization_factor=global_valid_toks)
        return loss, {"loss": float(loss), "num_valid_samples": data["input_ids"].shape[0]}


def _model(layout: dict) -> Any:
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    config = tiny_gpt_config(tensor_model_parallel_size=layout["tp"], sequence_parallel=layout["sp"], num_layers=2)
    return build_packed_gpt(vocab_size=kit.VOCAB, seq_length=64, seed=0, config=config)


def _step(model, cfg, teacher, loss_fn, patched: bool) -> tuple[float, list[torch.Tensor]]:
    """One training step of NeMo-RL's driver (loss summed over micro-batches, gradients kept)."""
    from nemo_rl.models.megatron.train import LossPostProcessor

    import megatron_rl_patches

    for param in model.parameters():
        param.grad = None
    post = LossPostProcessor(loss_fn, cfg, num_microbatches=2)
    if patched:
        megatron_rl_patches.apply(["nemo_rl_topk_kd"], strict=True)
    try:
        results = kit.drive(model, kit.batch(seed=5, teacher=teacher), cfg, post, mbs=2, forward_only=False)
    finally:
        if patched:
            megatron_rl_patches.revert()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    return sum(float(r["loss"]) for r in results), grads


def served_world(rank: int, world: int, layouts: list[dict],
                 teachers: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list:
    """For each served teacher's top-k, at each layout and kl_type: the patched loss and gradients,
    the float64 reference's, the control's loss (the served rows one position later) and NeMo-RL's
    own loss on the same batch."""
    import nemo_rl.models.megatron.train  # noqa: F401 - loaded before the shims, as nemo_ranks does
    from nemo_rl.algorithms.loss.loss_functions import DistillationLossConfig, DistillationLossFn

    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    results = []
    for layout in layouts:
        with megatron_on_cpu(tensor_parallel=layout["tp"]):
            cfg = kit.policy_cfg(tp=layout["tp"], sp=layout["sp"])
            model = _model(layout)
            for (route, teacher), kl_type in itertools.product(teachers.items(), KL_TYPES):
                shifted = (teacher[0].roll(1, dims=1), teacher[1].roll(1, dims=1))
                config = DistillationLossConfig(kl_type=kl_type, mixed_kl_weight=MIXED_WEIGHT)
                loss, grads = _step(model, cfg, teacher, DistillationLossFn(config), patched=True)
                reference, ref_grads = _step(model, cfg, teacher, Float64Reference(kl_type), patched=False)
                control, _ = _step(model, cfg, shifted, Float64Reference(kl_type), patched=False)
                own, _ = _step(model, cfg, teacher, DistillationLossFn(config), patched=False)
                results.append({
                    "route": route, "layout": layout["name"], "kl_type": kl_type, "loss": loss, "float64": reference,
                    "control": control, "nemo_rl_own": own,
                    "grad_err": max(float((a.double() - b.double()).abs().max()) for a, b in zip(grads, ref_grads)),
                    "grad_scale": max(float(b.abs().max()) for b in ref_grads),
                })
    return results
