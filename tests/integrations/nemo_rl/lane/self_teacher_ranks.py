"""The NeMo-RL lane's live self-teacher world: the student's own `get_topk_logits` (NeMo-RL's
driver with its TopkLogitsPostProcessor on `nemo_rl_topk`, what its Megatron worker runs) over
the privileged sequences through `StudentPolicyPass`, then NeMo-RL's distillation step
(`LossPostProcessor` over `DistillationLossFn` on `nemo_rl_topk_kd`) on those rows, at TP=1 and
TP=2 in one world; and NeMo-RL's own teacher Policy (other random weights, the same driver) over
the same privileged sequences through `PrivilegedTeacherPolicy`. Imported in each spawned rank
(the service stand-ins before NeMo-RL)."""
from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from megatron_rl_patches.testing.service_stubs import install_service_stubs  # noqa: E402

install_service_stubs()

import nemo_kit as kit  # noqa: E402
import nemo_ranks as ranks  # noqa: E402
import torch  # noqa: E402

TEACHER_SEED = 1  # NeMo-RL's own teacher Policy: weights other than the student's
CONTEXTS = (5, 2, 7, 4)  # each sample's privileged context length


def contexts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, kit.VOCAB, (n,), generator=gen) for n in CONTEXTS]


class StudentPolicy:
    """The student's `Policy.get_topk_logits` as NeMo-RL's Megatron worker runs it: its driver, no
    grad, the TopkLogitsPostProcessor (on `nemo_rl_topk`: whole-vocabulary log-probs)."""

    def __init__(self, model: Any, cfg: dict) -> None:
        self.model, self.cfg, self.calls = model, cfg, 0

    def get_topk_logits(self, data: Any, k: int, micro_batch_size: Any = None, timer: Any = None) -> dict:
        from nemo_rl.models.megatron.train import TopkLogitsPostProcessor

        self.calls += 1
        results = ranks._applied(("nemo_rl_topk",), lambda: kit.drive(
            self.model, data, self.cfg, TopkLogitsPostProcessor(self.cfg, k), mbs=2))
        return {"topk_logits": torch.cat([r["topk_logits"] for r in results]),
                "topk_indices": torch.cat([r["topk_indices"] for r in results])}


def self_teacher_world(rank: int, world: int, tps: list[int]) -> list[dict]:
    import nemo_rl.models.megatron.train  # noqa: F401 - loaded before the shims (as nemo_ranks.layout_world)
    from nemo_rl.algorithms.loss.loss_functions import DistillationLossConfig, DistillationLossFn
    from nemo_rl.models.megatron.train import LossPostProcessor

    from megatron_rl_patches.integrations.nemo_rl.privileged_teacher import privileged_teacher_policy
    from megatron_rl_patches.integrations.nemo_rl.self_teacher import self_teacher_policy
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    results = []
    for tp in tps:
        with megatron_on_cpu(tensor_parallel=tp):
            layout = ranks.layout(f"tp{tp}", tp=tp)
            cfg = kit.policy_cfg(tp=tp)
            model = ranks._model(layout, seed=0)
            data = kit.batch(seed=3)
            data["hint"] = contexts()
            before = {key: value.clone() for key, value in data.items() if isinstance(value, torch.Tensor)}
            student = StudentPolicy(model, cfg)
            teacher = self_teacher_policy("hint", student=student)
            rows = teacher.get_topk_logits(data, k=kit.K)
            untouched = all(torch.equal(before[key], data[key]) for key in before)
            for param in model.parameters():
                param.grad = None
            loss_fn = DistillationLossFn(DistillationLossConfig(kl_type="forward", zero_outside_topk=False))
            train = kit.batch(seed=3, teacher=(rows["topk_logits"], rows["topk_indices"]))
            post = LossPostProcessor(loss_fn, cfg, num_microbatches=2)
            done = ranks._applied(("nemo_rl_topk_kd",), lambda step=(model, train, cfg, post): kit.drive(
                *step, mbs=2, forward_only=False))
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
            own_teacher = StudentPolicy(ranks._model(layout, seed=TEACHER_SEED), cfg)  # NeMo-RL's teacher Policy
            privileged = privileged_teacher_policy("hint", teacher=own_teacher).get_topk_logits(data, k=kit.K)
            missing = ""
            try:  # a batch short of one context: refused before the student's pass (the driver is one process)
                bad = kit.batch(seed=3)
                bad["hint"] = contexts()[:3]
                teacher.get_topk_logits(bad, k=kit.K)
            except ValueError as error:
                missing = str(error)
            results.append({"tp": tp, "values": rows["topk_logits"], "ids": rows["topk_indices"],
                            "loss": sum(float(r["loss"]) for r in done), "grads": grads, "untouched": untouched,
                            "calls": student.calls, "missing": missing, "teacher_values": privileged["topk_logits"],
                            "teacher_ids": privileged["topk_indices"], "teacher_calls": own_teacher.calls})
    return results
