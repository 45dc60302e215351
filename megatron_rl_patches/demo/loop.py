"""The demo's RL loop: a tiny real megatron-core GPT actor, trained by a Megatron-style train()
once per rollout, distilled on-policy towards inference-only teachers."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from megatron_rl_patches.testing import megatron_cpu as kit

ACTOR_DDP_FLAGS = dict(overlap_grad_reduce=True, use_distributed_optimizer=True, overlap_param_gather=True)


@dataclass
class DemoConfig:
    rollouts: int = 4
    steps: int = 2  # optimizer steps per rollout
    microbatches: int = 2
    micro_batch_size: int = 4
    prompt_length: int = 4
    seq_length: int = 16
    vocab_size: int = 64
    teachers: int = 2
    topk: int = 8
    ids_from: str = "teacher"  # whose top-k ids the OPD buckets use: "teacher" (the first) or "student"
    opd_coef: float = 1.0
    pg_coef: float = 0.1
    temperature: float = 1.0
    lr: float = 1.0
    device: str = "cpu"  # "cuda" when the session runs on a GPU
    teacher_init_std: float = 0.3
    seed: int = 0


@dataclass
class RolloutResult:
    rollout: int
    loss: float
    opd_kl: float
    entropy: float
    logprob: float


@dataclass
class DemoState:
    config: DemoConfig
    actor: list
    teachers: list
    results: list[RolloutResult] = field(default_factory=list)


def megatron_style_train(
    rollout_id: int,
    model: Sequence[Any],
    step_batches: Sequence[Sequence[dict]],
    forward_step: Callable,
    lr: float,
) -> list[dict[str, float]]:
    """What Megatron-LM's and slime's train() do around the schedule, written for one call per
    job: sync functions installed behind an assert, forward-pre-hooks off at entry, on after
    step 0, off at exit. Called once per rollout it fails on rollout 2 without our patches."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    ddp_config = model[0].ddp_config
    if ddp_config.overlap_grad_reduce:
        assert config.no_sync_func is None, (
            "When overlap_grad_reduce is True, config.no_sync_func must be None; "
            "a custom no_sync_func is not supported when overlapping grad-reduce"
        )
        sync = [chunk.no_sync for chunk in model]
        config.no_sync_func = sync[0] if len(model) == 1 else sync
    config.finalize_model_grads_func = finalize_model_grads
    toggles_hooks = ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather
    if toggles_hooks:
        for chunk in model:
            chunk.disable_forward_pre_hook()
    per_step = []
    for step, batches in enumerate(step_batches):
        for chunk in model:
            chunk.zero_grad_buffer()
        metrics = kit.run_schedule(model, batches, forward_step)
        kit.sgd_step(model, lr)
        per_step.append({key: float(sum(m[key] for m in metrics) / len(metrics)) for key in metrics[0]})
        if step == 0 and toggles_hooks:
            for chunk in model:
                chunk.enable_forward_pre_hook()
    if toggles_hooks:
        for chunk in model:
            chunk.disable_forward_pre_hook()
    return per_step


def build_models(cfg: DemoConfig) -> tuple[list, list]:
    """The actor in real DDP (overlap + distributed-optimizer flags); teachers inference-only."""
    from megatron_rl_patches import build_inference_model

    actor_model = kit.build_tiny_gpt(vocab_size=cfg.vocab_size, seq_length=cfg.seq_length, seed=cfg.seed)
    actor = [kit.wrap_ddp(actor_model.to(cfg.device), **ACTOR_DDP_FLAGS)]
    # Teachers with a larger init scale have peaked next-token distributions, far from the
    # near-uniform fresh actor: the distillation signal is visible within a few steps.
    teacher_config = kit.tiny_gpt_config(init_method_std=cfg.teacher_init_std)
    teachers = [
        build_inference_model(
            kit.tiny_gpt_provider(teacher_config, vocab_size=cfg.vocab_size, seq_length=cfg.seq_length, seed=cfg.seed + 100 + j)
        )[0]
        for j in range(cfg.teachers)
    ]
    return actor, teachers


def _shifted_targets(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token targets for every position of [b, s]; the last position gets a dummy id (masked)."""
    return torch.roll(tokens, -1, dims=1)


@torch.no_grad()
def sample(model: Any, cfg: DemoConfig, gen: torch.Generator) -> dict:
    """On-policy samples: random prompts, responses drawn token by token from the actor."""
    b, s = cfg.micro_batch_size, cfg.seq_length
    batch = kit.make_batch(b, s, cfg.vocab_size, seed=int(torch.randint(0, 2**31, (1,), generator=gen)))
    batch = {key: value.to(cfg.device) for key, value in batch.items()}
    tokens = batch["tokens"]
    for pos in range(cfg.prompt_length, s):
        logits = kit.gpt_forward(model, {**batch, "tokens": tokens})[:, pos - 1].float().cpu() / cfg.temperature
        tokens[:, pos] = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1).to(cfg.device)
    loss_mask = torch.zeros(b, s, device=cfg.device)
    loss_mask[:, cfg.prompt_length - 1 : s - 1] = 1.0  # positions whose next token is a response token
    batch.update(tokens=tokens, labels=_shifted_targets(tokens), loss_mask=loss_mask)
    return batch


@torch.no_grad()
def score_with_teachers(batch: dict, actor: Any, teachers: Sequence[Any], cfg: DemoConfig) -> None:
    """Top-k ids from the old policy, teachers' full-vocab log-probs at those ids + tail, and the
    per-token reward log q_teacher(y) - log p_old(y) for the sampled token."""
    from megatron_rl_patches import log_probs_and_entropy, topk_ids, topk_logprobs

    targets = batch["labels"].reshape(-1)
    old_logits = kit.gpt_forward(actor, batch).float().reshape(-1, cfg.vocab_size)
    old_logp, _ = log_probs_and_entropy(old_logits, targets, temperature=cfg.temperature)
    teacher_logits = [kit.gpt_forward(t, batch).float().reshape(-1, cfg.vocab_size) for t in teachers]
    ids = topk_ids(teacher_logits[0] if cfg.ids_from == "teacher" else old_logits, cfg.topk)
    teacher_lp, teacher_tail, teacher_tok = [], [], []
    for logits in teacher_logits:
        lp, tail = topk_logprobs(logits, ids, temperature=cfg.temperature)
        teacher_lp.append(lp)
        teacher_tail.append(tail)
        teacher_tok.append(log_probs_and_entropy(logits, targets, temperature=cfg.temperature)[0])
    mixture_tok = torch.logsumexp(torch.stack(teacher_tok), 0) - math.log(len(teachers))
    batch.update(
        topk_ids=ids,
        teacher_logprobs=torch.stack(teacher_lp),
        teacher_tails=torch.stack(teacher_tail),
        advantages=_centered(mixture_tok - old_logp, batch["loss_mask"].reshape(-1)).reshape(batch["tokens"].shape),
    )


def _centered(reward: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reward minus its mean over the response tokens (a baseline: lower-variance gradient)."""
    return (reward - (reward * mask).sum() / mask.sum().clamp_min(1.0)) * mask


def make_forward_step(cfg: DemoConfig) -> Callable:
    """Forward step for the schedule: policy-gradient term with the teacher reward plus the top-k
    OPD term; log-prob and entropy (a metric: coefficient 0) from the memory-optimal Function."""
    from megatron_rl_patches import log_probs_and_entropy, topk_opd_loss

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = kit.gpt_forward(model, batch)

        def loss_func(output: torch.Tensor):
            flat = output.reshape(-1, cfg.vocab_size)
            mask = batch["loss_mask"].reshape(-1)
            logp, entropy = log_probs_and_entropy(
                flat, batch["labels"].reshape(-1), temperature=cfg.temperature,
                with_entropy=True, entropy_requires_grad=False,
            )
            opd = topk_opd_loss(
                flat, batch["topk_ids"], batch["teacher_logprobs"], batch["teacher_tails"],
                temperature=cfg.temperature,
            )
            pg = -batch["advantages"].reshape(-1) * logp  # REINFORCE with the teacher reward
            denom = mask.sum().clamp_min(1.0)
            loss = ((cfg.pg_coef * pg + cfg.opd_coef * opd) * mask).sum() / denom
            return loss, {
                "loss": loss.detach().clone(),
                "opd_kl": (opd.detach() * mask).sum() / denom,
                "entropy": (entropy * mask).sum() / denom,
                "logprob": (logp.detach() * mask).sum() / denom,
            }

        return logits, loss_func

    return forward_step
