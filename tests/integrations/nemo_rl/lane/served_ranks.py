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


class VocabFloat64Reference:
    """A NeMo-RL loss on its own logits (`LossInputType.LOGIT`, unpatched): the whole-vocabulary KL
    of NeMo-RL's `kl_type` in float64 between the student's logits (gathered over the TP group,
    their gradient through the gather) and the batch's served teacher hidden states through the
    teacher's whole head (float64), masked and normalized as NeMo-RL's distillation loss."""

    def __init__(self, kl_type: str, head: torch.Tensor, vocab: int) -> None:
        from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType

        self.loss_type, self.input_type = LossType.TOKEN_LEVEL, LossInputType.LOGIT
        self.kl_type, self.head, self.vocab = kl_type, head, vocab

    def __call__(self, *, logits, data, global_valid_toks, **_ignored):
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
        from nemo_rl.algorithms.utils import masked_mean

        whole = gather_from_tensor_model_parallel_region(logits)
        length = whole.shape[1] - 1
        p = torch.log_softmax(whole[:, :length, :self.vocab].double(), -1)
        q = torch.log_softmax(data["teacher_hidden_states"][:, :length].double() @ self.head.T, -1)
        forward = (q.exp() * (q - p)).sum(-1)
        reverse = (p.exp() * (p - q)).sum(-1)
        per_token = {"forward": forward, "reverse": reverse,
                     "mixed": MIXED_WEIGHT * forward + (1 - MIXED_WEIGHT) * reverse}[self.kl_type]
        mask = data["token_mask"][:, 1:][:, :length] * data["sample_mask"].unsqueeze(-1)
        loss = masked_mean(per_token, mask.double(), global_normalization_factor=global_valid_toks)
        return loss, {"loss": float(loss), "num_valid_samples": data["input_ids"].shape[0]}


def _model(layout: dict) -> Any:
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    config = tiny_gpt_config(tensor_model_parallel_size=layout["tp"], sequence_parallel=layout["sp"], num_layers=2)
    return build_packed_gpt(vocab_size=kit.VOCAB, seq_length=64, seed=0, config=config)


def _step(model, cfg, teacher, loss_fn, patched: bool, states: torch.Tensor | None = None
          ) -> tuple[float, list[torch.Tensor]]:
    """One training step of NeMo-RL's driver (loss summed over micro-batches, gradients kept)."""
    from nemo_rl.models.megatron.train import LossPostProcessor

    import megatron_rl_patches

    for param in model.parameters():
        param.grad = None
    post = LossPostProcessor(loss_fn, cfg, num_microbatches=2)
    if patched:
        megatron_rl_patches.apply(["nemo_rl_topk_kd"], strict=True)
    try:
        data = kit.batch(seed=5, teacher=teacher)
        if states is not None:
            data["teacher_hidden_states"] = states
        results = kit.drive(model, data, cfg, post, mbs=2, forward_only=False)
    finally:
        if patched:
            megatron_rl_patches.revert()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    return sum(float(r["loss"]) for r in results), grads


def _vocab_results(model, cfg, layout: dict, vocab: dict) -> list:
    """The whole-vocabulary route at one layout, each kl_type: the loss `served_teacher_in_setup`
    builds (`WholeVocabularyDistillationLossFn`) on the patched step against the float64 reference
    on NeMo-RL's own logits, and the reference with the served states one position later."""
    from megatron_rl_patches.integrations.nemo_rl.vocab_kd import WholeVocabularyDistillationLossFn
    from megatron_rl_patches.teachers.head.teacher_head import TeacherHead

    head = TeacherHead.from_hf(vocab["head"], dtype=torch.float64).weight
    states, teacher = vocab["states"], vocab["topk"]
    results = []
    for kl_type in KL_TYPES:
        config = {"kl_type": kl_type, "mixed_kl_weight": MIXED_WEIGHT, "zero_outside_topk": False}
        loss, grads = _step(model, cfg, teacher, WholeVocabularyDistillationLossFn(config, head=vocab["head"]),
                            patched=True, states=states)
        reference, ref_grads = _step(model, cfg, teacher, VocabFloat64Reference(kl_type, head, kit.VOCAB),
                                     patched=False, states=states)
        control, _ = _step(model, cfg, teacher, VocabFloat64Reference(kl_type, head, kit.VOCAB), patched=False,
                           states=states.roll(1, dims=1))
        results.append({
            "route": "vocab", "layout": layout["name"], "kl_type": kl_type, "loss": loss, "float64": reference,
            "control": control,
            "grad_err": max(float((a.double() - b.double()).abs().max()) for a, b in zip(grads, ref_grads)),
            "grad_scale": max(float(b.abs().max()) for b in ref_grads),
        })
    return results


def served_world(rank: int, world: int, layouts: list[dict],
                 teachers: dict[str, tuple[torch.Tensor, torch.Tensor]], vocab: dict | None = None) -> list:
    """For each served teacher's top-k, at each layout and kl_type: the patched loss and gradients,
    the float64 reference's, the control's loss (the served rows one position later) and NeMo-RL's
    own loss on the same batch; with `vocab` (the served hidden states, the head's directory) the
    whole-vocabulary route too."""
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
            if vocab is not None:
                results.extend(_vocab_results(model, cfg, layout, vocab))
    return results
