"""Top-k on-policy distillation with real megatron-core GPT models on CPU (docs/topk-opd.md): a
student GPT trained on its own samples towards a 0.7/0.3 mixture of two inference-only teacher
GPTs, k = 8.

    .venv/bin/python examples/topk_opd_cpu.py [--steps 8] [--seed 0]

megatron-core runs on CPU through the test kit's shims (megatron_rl_patches.testing); on a GPU
machine, initialize Megatron as usual instead of entering `megatron_on_cpu()`.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches import build_inference_model, topk_ids, topk_logprobs, topk_opd_loss
from megatron_rl_patches.testing import megatron_cpu as kit

VOCAB = 64
SEQ = 16
PROMPT = 4  # random prompt tokens; the student samples the other SEQ - PROMPT
BATCH = 8
K = 8
TEACHER_WEIGHTS = (0.7, 0.3)
# A freshly initialized GPT (std 0.02) predicts nearly uniformly; std 0.3 gives every model sharp
# opinions of its own, standing in for pretrained models that disagree.
INIT_STD = 0.3
LR = 1e-2


@dataclass
class StepRecord:
    """What one distillation step did (passed to `main`'s `on_step` after the optimizer step)."""

    step: int
    loss: float  # top-k OPD loss: reverse KL over the k + 1 buckets, mean over response tokens
    full_kl: float  # reverse KL over the full vocabulary to the teacher mixture (a check only)
    teacher_mass: float  # mixture mass on the student's k ids (1 - tail), mean over tokens
    student: torch.nn.Module
    teachers: list[torch.nn.Module]


def build_student(seed: int) -> torch.nn.Module:
    """The trainable student: a plain GPTModel (no DDP needed at data-parallel size 1)."""
    config = kit.tiny_gpt_config(init_method_std=INIT_STD)
    return kit.build_tiny_gpt(config, vocab_size=VOCAB, seq_length=SEQ, seed=seed)


def build_teachers(seed: int) -> list[torch.nn.Module]:
    """Two teachers, wider than the student, built inference-only: no DDP, no grads, eval mode."""
    config = kit.tiny_gpt_config(hidden_size=64, init_method_std=INIT_STD)
    return [
        build_inference_model(kit.tiny_gpt_provider(config, vocab_size=VOCAB, seq_length=SEQ, seed=seed + 1 + j))[0]
        for j in range(len(TEACHER_WEIGHTS))
    ]


@torch.no_grad()
def sample(student: torch.nn.Module, batch_seed: int, gen: torch.Generator) -> dict:
    """On-policy data: random prompts, then the student's own samples token by token."""
    batch = kit.make_batch(BATCH, SEQ, VOCAB, seed=batch_seed)
    tokens = batch["tokens"]
    for pos in range(PROMPT, SEQ):
        logits = kit.gpt_forward(student, batch)[:, pos - 1]
        tokens[:, pos] = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen).squeeze(-1)
    return batch


def response_logits(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Logits [b, SEQ - PROMPT, V] at the positions whose next token the student sampled."""
    return kit.gpt_forward(model, batch)[:, PROMPT - 1 : SEQ - 1]


def distill_step(
    student: torch.nn.Module, teachers: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer, batch: dict
) -> tuple[float, float, float]:
    """One top-k OPD step; returns (top-k loss, full-vocab KL, teacher mass on the ids)."""
    logits = response_logits(student, batch)
    ids = topk_ids(logits.detach(), K)  # the student's own top-k: on-policy buckets
    with torch.no_grad():
        teacher_logits = [response_logits(teacher, batch) for teacher in teachers]
        logprobs, tails = zip(*(topk_logprobs(t, ids) for t in teacher_logits))
    loss = topk_opd_loss(
        logits, ids, torch.stack(logprobs), torch.stack(tails), teacher_weights=list(TEACHER_WEIGHTS),
        divergence="reverse_kl",
    ).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

    with torch.no_grad():  # the [T, V] comparison a real run would not afford
        weights = torch.tensor(TEACHER_WEIGHTS)[:, None, None]
        log_q = torch.logsumexp(torch.stack([t.log_softmax(-1) for t in teacher_logits]) + weights.log()[..., None], 0)
        log_p = logits.detach().log_softmax(-1)
        full_kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
        teacher_mass = 1.0 - (weights * torch.stack(tails).exp()).sum(0).mean()
    return loss.item(), full_kl.item(), teacher_mass.item()


def main(steps: int = 8, seed: int = 0, on_step: Callable[[StepRecord], Any] | None = None) -> list[float]:
    """Distill for `steps` steps and return the per-step top-k OPD losses."""
    for name, value, low in (("steps", steps, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    losses = []
    with kit.megatron_on_cpu(seed=seed):
        student = build_student(seed)
        teachers = build_teachers(seed + 100)
        optimizer = torch.optim.Adam(student.parameters(), lr=LR)
        gen = torch.Generator().manual_seed(seed)
        for step in range(steps):
            batch = sample(student, batch_seed=seed * 1000 + step, gen=gen)
            loss, full_kl, teacher_mass = distill_step(student, teachers, optimizer, batch)
            losses.append(loss)
            if on_step is not None:
                on_step(StepRecord(step, loss, full_kl, teacher_mass, student, teachers))
    return losses


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", module="megatron")  # Apex / Transformer Engine absent on CPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"student GPT + {len(TEACHER_WEIGHTS)} inference-only teacher GPTs, vocab {VOCAB}, k = {K}, "
          f"{BATCH} x {SEQ - PROMPT} sampled tokens per step, Adam lr {LR}")
    print(f"{'step':>4}  {'top-k loss':>10}  {'full KL':>8}  {'teacher mass on ids':>19}")
    main(
        args.steps,
        args.seed,
        on_step=lambda r: print(f"{r.step:>4}  {r.loss:>10.4f}  {r.full_kl:>8.4f}  {r.teacher_mass:>19.3f}"),
    )
