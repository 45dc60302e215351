"""`nemo_rl_topk_kd` on NeMo-RL's own driver in this process (one rank): its loss wrapper, the
student's buckets and the teacher's ids at the packed rows are reached here, not only inside the
spawned ranks of test_nemo_rl_lane.py (which mutation testing cannot map). The exact (k+1)-bucket
KL of each `kl_type`, unpacked and packed, against float64 from the student's whole-vocabulary
top-k log-probs (NeMo-RL's own `zero_outside_topk=True` inputs)."""
from __future__ import annotations

import pytest

pytest.importorskip("nemo_rl", reason="NeMo-RL's source is not on the path: run `make test-nemo NEMO_RL=...`")
pytestmark = pytest.mark.nemo_rl

import nemo_kit as kit  # noqa: E402
import torch  # noqa: E402

import megatron_rl_patches  # noqa: E402

WEIGHT = 0.3  # mixed_kl_weight: forward and reverse weighted unequally


class InputsKept:
    """NeMo-RL's own DistillationLossFn, the student's top-k log-probs it is given kept."""

    def __init__(self, cfg) -> None:
        from nemo_rl.algorithms.loss.loss_functions import DistillationLossFn

        self.inner = DistillationLossFn(cfg)
        self.loss_type, self.input_type = self.inner.loss_type, self.inner.input_type
        self.kl_type, self.mixed_kl_weight = self.inner.kl_type, self.inner.mixed_kl_weight
        self.zero_outside_topk = self.inner.zero_outside_topk
        self.seen: list[torch.Tensor] = []

    def __call__(self, **kwargs):
        self.seen.append(kwargs["student_topk_logprobs"].detach())
        return self.inner(**kwargs)


def reference_kl(student: torch.Tensor, teacher: torch.Tensor, kl_type: str) -> torch.Tensor:
    """[B, S−1] (k+1)-bucket KL in float64 from both sides' whole-vocabulary top-k log-probs."""
    p, q = student.double(), teacher.double()
    p = torch.cat([p, torch.log1p(-p.exp().sum(-1).clamp(max=1 - 1e-12))[..., None]], -1)
    q = torch.cat([q, torch.log1p(-q.exp().sum(-1).clamp(max=1 - 1e-12))[..., None]], -1)
    forward, reverse = (q.exp() * (q - p)).sum(-1), (p.exp() * (p - q)).sum(-1)
    return {"forward": forward, "reverse": reverse}.get(kl_type, WEIGHT * forward + (1 - WEIGHT) * reverse)


def test_the_exact_topk_loss_in_one_process_equals_float64_unpacked_and_packed(nemo_cpu):
    from nemo_rl.algorithms.loss.loss_functions import DistillationLossConfig
    from nemo_rl.models.megatron.train import LogprobsPostProcessor, LossPostProcessor, TopkLogitsPostProcessor

    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    student, teacher_model = (build_packed_gpt(vocab_size=kit.VOCAB, seq_length=64, seed=seed) for seed in (0, 7))
    cfg = kit.policy_cfg()
    megatron_rl_patches.apply(["nemo_rl_topk"], strict=True)
    rows = kit.drive(teacher_model, kit.batch(seed=3), cfg, TopkLogitsPostProcessor(cfg, kit.K), mbs=2)
    megatron_rl_patches.revert()
    teacher = (torch.cat([r["topk_logits"] for r in rows]), torch.cat([r["topk_indices"] for r in rows]))
    own = kit.drive(student, kit.batch(seed=1), cfg, LogprobsPostProcessor(cfg, None), mbs=2)
    megatron_rl_patches.apply(["nemo_rl_topk_kd"], strict=True)
    try:  # a step whose post-processor is no distillation loss: NeMo-RL's own, called as NeMo-RL called it
        through = kit.drive(student, kit.batch(seed=1), cfg, LogprobsPostProcessor(cfg, None), mbs=2)
    finally:
        megatron_rl_patches.revert()
    assert all(torch.equal(a["logprobs"], b["logprobs"]) for a, b in zip(own, through, strict=True))

    kept = InputsKept(DistillationLossConfig(kl_type="forward", zero_outside_topk=True))
    kit.drive(student, kit.batch(seed=3, teacher=teacher), cfg, LossPostProcessor(kept, cfg, num_microbatches=2),
              mbs=2)
    data = kit.batch(seed=3, teacher=teacher)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    for kl_type, packed in (("forward", False), ("reverse", False), ("mixed", False), ("mixed", True)):
        expected = (reference_kl(torch.cat(kept.seen), teacher[0][:, :-1], kl_type) * mask).sum() / mask.sum()
        loss = LossPostProcessor(InputsKept(DistillationLossConfig(kl_type=kl_type, mixed_kl_weight=WEIGHT)),
                                 kit.policy_cfg(packed=packed), num_microbatches=2)
        megatron_rl_patches.apply(["nemo_rl_topk_kd"], strict=True)
        try:
            got = kit.drive(student, kit.batch(seed=3, teacher=teacher), kit.policy_cfg(packed=packed), loss, mbs=2)
        finally:
            megatron_rl_patches.revert()
        assert not loss.loss_fn.seen  # NeMo-RL's own loss replaced
        total = sum(float(r["loss"]) for r in got)  # each micro-batch its share of the global mean
        assert abs(total - float(expected)) < 1e-5 * max(1.0, abs(float(expected))), (kl_type, packed, total,
                                                                                         float(expected))


def test_a_custom_prepare_fn_falls_back_to_nemo_rls_own_loss(nemo_cpu):
    from functools import partial

    from nemo_rl.algorithms.loss.loss_functions import DistillationLossConfig, DistillationLossFn
    from nemo_rl.algorithms.loss.utils import prepare_loss_input
    from nemo_rl.models.megatron.train import LossPostProcessor

    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    student = build_packed_gpt(vocab_size=kit.VOCAB, seq_length=64, seed=0)
    cfg = kit.policy_cfg()
    gen = torch.Generator().manual_seed(5)
    teacher = (torch.randn(kit.BATCH, kit.SEQ, kit.K, generator=gen),
               torch.randint(0, kit.VOCAB, (kit.BATCH, kit.SEQ, kit.K), generator=gen))

    def losses() -> list[float]:
        post = LossPostProcessor(DistillationLossFn(DistillationLossConfig()), cfg, num_microbatches=2,
                                 prepare_fn=partial(prepare_loss_input, chunk_size=kit.CHUNK))
        return [float(r["loss"]) for r in kit.drive(student, kit.batch(seed=3, teacher=teacher), cfg, post, mbs=2)]

    own = losses()
    megatron_rl_patches.apply(["nemo_rl_topk_kd"], strict=True)
    try:
        assert losses() == own  # raw logits accepted: NeMo-RL's own loss, called as NeMo-RL called it
    finally:
        megatron_rl_patches.revert()
